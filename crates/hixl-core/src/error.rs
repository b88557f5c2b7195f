//! The one error type of the engine layer: a [`Status`] code plus a message that names the
//! offending value.

use std::fmt;

/// Status codes of the public contract: their one definition. The numbers are stable; the
/// Python layer's `hixl.Status` is checked against [`Status::ALL`] by the tests.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum Status {
    /// The call succeeded.
    Success = 0,
    /// A caller-supplied value is wrong (address outside a region, overlap, bad option...).
    ParamInvalid = 103900,
    /// The peer did not answer in time.
    Timeout = 103901,
    /// No usable link to the peer.
    NotConnected = 103902,
    /// A second connect to the same peer.
    AlreadyConnected = 103903,
    /// A notification could not be delivered.
    NotifyFailed = 103904,
    /// Memory type or backend not available on this machine.
    Unsupported = 103905,
    /// A bounded resource (request queue, notify buffer) is full.
    ResourceExhausted = 203900,
    /// Anything else, including use after finalize.
    Failed = 503900,
}

impl Status {
    /// Every status code.
    pub const ALL: [Status; 9] = [
        Status::Success,
        Status::ParamInvalid,
        Status::Timeout,
        Status::NotConnected,
        Status::AlreadyConnected,
        Status::NotifyFailed,
        Status::Unsupported,
        Status::ResourceExhausted,
        Status::Failed,
    ];

    /// The numeric code.
    pub fn code(self) -> u32 {
        self as u32
    }

    /// Parses a numeric code (as carried on the wire); unknown numbers become `Failed`.
    pub fn from_code(code: u32) -> Status {
        Self::ALL.into_iter().find(|s| s.code() == code).unwrap_or(Status::Failed)
    }

    /// The upper-case name used in docs and messages.
    pub fn name(self) -> &'static str {
        match self {
            Status::Success => "SUCCESS",
            Status::ParamInvalid => "PARAM_INVALID",
            Status::Timeout => "TIMEOUT",
            Status::NotConnected => "NOT_CONNECTED",
            Status::AlreadyConnected => "ALREADY_CONNECTED",
            Status::NotifyFailed => "NOTIFY_FAILED",
            Status::Unsupported => "UNSUPPORTED",
            Status::ResourceExhausted => "RESOURCE_EXHAUSTED",
            Status::Failed => "FAILED",
        }
    }
}

/// An engine error: a status and a human-readable message naming the value that was wrong.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    /// The status code.
    pub status: Status,
    /// What went wrong, with the offending value.
    pub message: String,
}

impl Error {
    /// Builds an error from a status and message.
    pub fn new(status: Status, message: impl Into<String>) -> Self {
        Error { status, message: message.into() }
    }
    /// `PARAM_INVALID` with a message.
    pub fn param(message: impl Into<String>) -> Self {
        Self::new(Status::ParamInvalid, message)
    }
    /// `FAILED` with a message.
    pub fn failed(message: impl Into<String>) -> Self {
        Self::new(Status::Failed, message)
    }
    /// `NOT_CONNECTED` with a message.
    pub fn not_connected(message: impl Into<String>) -> Self {
        Self::new(Status::NotConnected, message)
    }
    /// `TIMEOUT` with a message.
    pub fn timeout(message: impl Into<String>) -> Self {
        Self::new(Status::Timeout, message)
    }
    /// The same error, its message prefixed with `what: ` (which descriptor, which peer).
    pub fn context(mut self, what: &str) -> Self {
        self.message = format!("{what}: {}", self.message);
        self
    }

    /// The numeric status code.
    pub fn code(&self) -> u32 {
        self.status.code()
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({}): {}", self.status.name(), self.status.code(), self.message)
    }
}

impl std::error::Error for Error {}

/// The engine's result type.
pub type Result<T> = std::result::Result<T, Error>;
