//! The sans-IO wire protocol: frame encoding and decoding as pure functions.
//!
//! Every frame starts with a fixed 24-byte header:
//!
//! ```text
//! 0  magic "HX" | 2 version | 3 kind | 4 payload_len u32 | 8 tag u64 | 16 bulk_len u64
//! ```
//!
//! followed by `payload_len` bytes of payload (descriptors, strings) and then `bulk_len` bytes
//! of raw data that the I/O layer moves straight between the socket and registered memory (it
//! never passes through this module). All integers are little endian. Decoding validates every
//! field and every length against the limits below before anything is allocated.

use std::fmt;

mod decode;
mod direction;
pub mod rdma;
mod region;
mod strided;

pub use decode::decode_payload;
use decode::Reader;
pub use direction::{after_handshake, TO_INITIATOR, TO_TARGET};
pub use strided::StridedRanges;

use region::{put_capabilities, put_ids, put_regions};
pub use region::{
    BackendKey, Capability, Domain, RegionEntry, MAX_BACKEND_NAME, MAX_CAPABILITIES, MAX_DOMAIN_PAIRS,
    MAX_KEYS, MAX_KEY_LEN, MAX_REGIONS, MAX_REGION_NAME,
};

/// Frame magic.
pub const MAGIC: [u8; 2] = *b"HX";
/// Protocol version; a peer with another version is refused at the handshake.
pub const VERSION: u8 = 4;
/// Size of the fixed header.
pub const HEADER_LEN: usize = 24;
/// Most descriptors in one data frame.
pub const MAX_DESCS: usize = 1 << 16;
/// Most elements of one strided frame whose elements are not contiguous (stride > size): a
/// target walks no more separate ranges for one frame than for the largest list frame. A
/// frame over it is refused (PARAM_INVALID) and the stream goes on; initiators split larger
/// strided transfers into several frames. Contiguous elements (stride == size) are one range
/// and have no such cap.
pub const MAX_STRIDED_ELEMS: u64 = MAX_DESCS as u64;
/// Largest payload (descriptor table, strings) of any frame.
pub const MAX_PAYLOAD: u32 = 4 << 20;
/// Longest engine id / notify name in bytes.
pub const MAX_NAME: usize = 1024;
/// Longest notify message / error message in bytes.
pub const MAX_MSG: usize = 1 << 20;
/// Largest payload of a frame that carries a region table (Welcome, RegionsTable,
/// RegionsUpdate, RegionsDelta).
pub const MAX_TABLE_PAYLOAD: u32 = 16 << 20;
/// Most bytes a registry's encoded entries may take, leaving room for the rest of a Welcome.
pub const MAX_TABLE_BYTES: usize = MAX_TABLE_PAYLOAD as usize - (64 << 10);
/// Hello flag: MAC every frame's bulk bytes too (sealed streams only).
pub const FLAG_DATA_MAC: u32 = 1;
/// Hello flag: this stream belongs to a data path (the `tcp` backend's streams), not to a
/// control channel: the target sends it no region table (an empty one in Welcome) and no
/// table updates.
pub const FLAG_DATA_PATH: u32 = 2;
/// Every Hello flag this version knows.
pub const KNOWN_FLAGS: u32 = FLAG_DATA_MAC | FLAG_DATA_PATH;
/// Largest Hello payload: two names, the dialled address and the fixed fields.
pub const MAX_HELLO: u32 = 4096;
/// Largest payload a backend carries in BackendOpen / BackendOpened (its connection details).
pub const MAX_BACKEND_PAYLOAD: usize = 64 << 10;

/// The largest payload a frame of `kind` may declare; checked on the header, before any payload
/// byte is read or any memory is set aside for it.
pub const fn max_payload(kind: Kind) -> u32 {
    let msg = 8 + MAX_MSG as u32;
    match kind {
        Kind::Hello => MAX_HELLO,
        Kind::Welcome | Kind::RegionsTable | Kind::RegionsUpdate | Kind::RegionsDelta => MAX_TABLE_PAYLOAD,
        Kind::Write | Kind::Read => 4 + 16 * MAX_DESCS as u32,
        Kind::ReadResp | Kind::Ack | Kind::Error => msg,
        Kind::Notify => msg + MAX_NAME as u32,
        Kind::Heartbeat | Kind::HeartbeatAck | Kind::Bye | Kind::RegionsQuery => 0,
        Kind::RegionsAck => 8,
        Kind::WriteStrided | Kind::ReadStrided => 32,
        Kind::AuthChallenge => 68 + MAX_NAME as u32,
        Kind::AuthResponse => 32,
        Kind::BackendOpen => 1 + MAX_BACKEND_NAME as u32 + 4 + MAX_BACKEND_PAYLOAD as u32,
        Kind::BackendOpened => 4 + msg + 4 + MAX_BACKEND_PAYLOAD as u32,
    }
}

/// What went wrong while decoding; the I/O layer treats it as a protocol violation.
#[derive(Clone, Debug, PartialEq, Eq)]
#[allow(missing_docs)] // variant fields: named for what they hold, described by the variant
pub enum WireError {
    /// The first two bytes are not "HX".
    BadMagic([u8; 2]),
    /// The peer speaks another protocol version.
    BadVersion(u8),
    /// Unknown frame kind byte.
    BadKind(u8),
    /// A length field exceeds its limit.
    TooLarge { field: &'static str, value: u64, limit: u64 },
    /// The payload ended before a field was complete.
    Truncated { field: &'static str },
    /// Bytes left over after the last field.
    Trailing(usize),
    /// A field holds an impossible value.
    Invalid { field: &'static str, value: u64 },
    /// A string is not UTF-8.
    Utf8 { field: &'static str },
    /// An engine id or host name holds a control character (at that byte): such names are
    /// printable text, so that no peer can put a newline or an escape sequence in a log line.
    Control { field: &'static str, at: usize },
    /// A frame of a kind this direction never carries after the handshake (see
    /// [`after_handshake`]); `to_target`: it came from an initiator.
    Direction { kind: Kind, to_target: bool },
}

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WireError::BadMagic(m) => write!(
                f,
                "the peer is not a hixl engine: its first bytes are {:?}, not the frame magic \"HX\"",
                String::from_utf8_lossy(m)
            ),
            WireError::BadVersion(v) => {
                write!(f, "protocol version {v} is not supported (this engine speaks {VERSION})")
            }
            WireError::BadKind(k) => write!(f, "unknown frame kind {k}"),
            WireError::TooLarge { field, value, limit } => {
                write!(f, "{field}={value} exceeds the limit {limit}")
            }
            WireError::Truncated { field } => write!(f, "frame truncated in field {field}"),
            WireError::Trailing(n) => write!(f, "{n} unexpected trailing bytes in frame"),
            WireError::Invalid { field, value } => write!(f, "invalid {field}={value}"),
            WireError::Utf8 { field } => write!(f, "{field} is not valid UTF-8"),
            WireError::Control { field, at } => write!(
                f,
                "{field} holds a control character at byte {at}: engine ids and host names are \
                 printable text"
            ),
            WireError::Direction { kind, to_target } => {
                let (from, to) =
                    if *to_target { ("an initiator", "a target") } else { ("a target", "an initiator") };
                write!(
                    f,
                    "unexpected {kind:?} frame from {from}: after the handshake {to} accepts only {:?}",
                    if *to_target { TO_TARGET } else { TO_INITIATOR }
                )
            }
        }
    }
}

impl std::error::Error for WireError {}

/// Frame kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// Initiator's first frame on every stream.
    Hello = 1,
    /// Target's answer to Hello, with its region table.
    Welcome = 2,
    /// Write descriptors, followed by the bytes.
    Write = 3,
    /// Read descriptors.
    Read = 4,
    /// Answer to Read: status, then the bytes on success.
    ReadResp = 5,
    /// Answer to Write / Notify / Bye.
    Ack = 6,
    /// A notification.
    Notify = 7,
    /// Liveness probe.
    Heartbeat = 8,
    /// Answer to Heartbeat.
    HeartbeatAck = 9,
    /// Fatal protocol error; the stream closes after it.
    Error = 10,
    /// Orderly close.
    Bye = 11,
    /// Ask for the current region table.
    RegionsQuery = 12,
    /// Answer to RegionsQuery.
    RegionsTable = 13,
    /// Target -> initiator, unsolicited: the target's region table changed.
    RegionsUpdate = 14,
    /// Initiator -> target: the update was applied and no direct access uses a removed region.
    RegionsAck = 15,
    /// A strided write: one descriptor, followed by `count * size` bytes.
    WriteStrided = 16,
    /// A strided read: one descriptor.
    ReadStrided = 17,
    /// Target -> initiator after Hello, when the target has a cluster secret: its nonce and
    /// its proof (see `auth`).
    AuthChallenge = 18,
    /// Initiator -> target: the initiator's proof.
    AuthResponse = 19,
    /// Target -> initiator, unsolicited: the changes of the region table since a version.
    RegionsDelta = 20,
    /// Initiator -> target on a control channel: open a backend's data path (its connection
    /// details, e.g. RDMA queue-pair addresses).
    BackendOpen = 21,
    /// Answer to BackendOpen: a status and the target's connection details.
    BackendOpened = 22,
}

impl Kind {
    fn from_u8(b: u8) -> Result<Kind, WireError> {
        Ok(match b {
            1 => Kind::Hello,
            2 => Kind::Welcome,
            3 => Kind::Write,
            4 => Kind::Read,
            5 => Kind::ReadResp,
            6 => Kind::Ack,
            7 => Kind::Notify,
            8 => Kind::Heartbeat,
            9 => Kind::HeartbeatAck,
            10 => Kind::Error,
            11 => Kind::Bye,
            12 => Kind::RegionsQuery,
            13 => Kind::RegionsTable,
            14 => Kind::RegionsUpdate,
            15 => Kind::RegionsAck,
            16 => Kind::WriteStrided,
            17 => Kind::ReadStrided,
            18 => Kind::AuthChallenge,
            19 => Kind::AuthResponse,
            20 => Kind::RegionsDelta,
            21 => Kind::BackendOpen,
            22 => Kind::BackendOpened,
            _ => return Err(WireError::BadKind(b)),
        })
    }
}

/// The fixed frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// Frame kind.
    pub kind: Kind,
    /// Payload bytes after the header.
    pub payload_len: u32,
    /// Correlates answers with requests.
    pub tag: u64,
    /// Raw data bytes after the payload.
    pub bulk_len: u64,
}

/// A remote memory segment named in a data frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Seg {
    /// Address in the target's registered memory.
    pub addr: u64,
    /// Length in bytes (>= 1).
    pub len: u64,
}

/// `count` elements of `size` bytes at `addr + i * stride` in the target's memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StridedSeg {
    /// Address of element 0.
    pub addr: u64,
    /// Elements (>= 1).
    pub count: u64,
    /// Bytes per element (>= 1).
    pub size: u64,
    /// Distance between elements (>= size).
    pub stride: u64,
}

impl StridedSeg {
    /// Bytes moved (`count * size`), or None on overflow.
    pub fn bytes(&self) -> Option<u64> {
        self.count.checked_mul(self.size)
    }
    /// Bytes from element 0 to the end of the last element, or None on overflow.
    pub fn span(&self) -> Option<u64> {
        (self.count - 1).checked_mul(self.stride)?.checked_add(self.size)
    }
}

/// A decoded frame (payload only; bulk bytes are moved by the I/O layer).
#[derive(Clone, Debug, PartialEq, Eq)]
#[allow(missing_docs)] // variant fields: described by each variant and docs/PROTOCOL.md
pub enum Frame {
    /// See [`Kind::Hello`].
    Hello {
        engine_id: String,
        host: String,
        link_nonce: u64,
        stream_index: u16,
        stream_count: u16,
        /// Fresh random challenge for the target (used when it has a cluster secret).
        auth_nonce: [u8; 32],
        /// `FLAG_*` bits.
        flags: u32,
        /// The address the initiator's socket is connected to (bound into the auth proofs).
        dialled: String,
    },
    /// See [`Kind::Welcome`]. `host` identifies the machine (boot id and host name), a hint
    /// only; `capabilities` are the data paths the target offers, in its order of preference;
    /// `table_version` is the version of `regions`.
    Welcome {
        engine_id: String,
        host: String,
        table_version: u64,
        capabilities: Vec<Capability>,
        regions: Vec<RegionEntry>,
    },
    /// See [`Kind::Write`]; `bulk_len` equals the sum of the segment lengths.
    Write { segs: Vec<Seg> },
    /// See [`Kind::Read`].
    Read { segs: Vec<Seg> },
    /// See [`Kind::ReadResp`]; bytes follow only when `status == 0`.
    ReadResp { status: u32, message: String },
    /// See [`Kind::Ack`].
    Ack { status: u32, message: String },
    /// See [`Kind::Notify`].
    Notify { name: String, msg: String },
    /// See [`Kind::Heartbeat`].
    Heartbeat,
    /// See [`Kind::HeartbeatAck`].
    HeartbeatAck,
    /// See [`Kind::Error`].
    Error { status: u32, message: String },
    /// See [`Kind::Bye`].
    Bye,
    /// See [`Kind::RegionsQuery`].
    RegionsQuery,
    /// See [`Kind::RegionsTable`].
    RegionsTable { version: u64, regions: Vec<RegionEntry> },
    /// See [`Kind::RegionsUpdate`].
    RegionsUpdate { version: u64, regions: Vec<RegionEntry> },
    /// See [`Kind::RegionsAck`].
    RegionsAck { version: u64 },
    /// See [`Kind::RegionsDelta`]: turns table `from` (or any newer one older than `version`)
    /// into table `version`: `removed` ids go, `added` entries are inserted or replaced by id.
    RegionsDelta { from: u64, version: u64, added: Vec<RegionEntry>, removed: Vec<u64> },
    /// See [`Kind::WriteStrided`].
    WriteStrided { seg: StridedSeg },
    /// See [`Kind::ReadStrided`].
    ReadStrided { seg: StridedSeg },
    /// See [`Kind::AuthChallenge`]; `engine_id` is the target's, bound into the proofs.
    AuthChallenge { nonce: [u8; 32], proof: [u8; 32], engine_id: String },
    /// See [`Kind::AuthResponse`].
    AuthResponse { proof: [u8; 32] },
    /// See [`Kind::BackendOpen`]: `payload` is meaningful to `backend` only.
    BackendOpen { backend: String, payload: Vec<u8> },
    /// See [`Kind::BackendOpened`]: `payload` is empty unless `status == 0`.
    BackendOpened { status: u32, message: String, payload: Vec<u8> },
}

impl Frame {
    /// The frame's kind.
    pub fn kind(&self) -> Kind {
        match self {
            Frame::Hello { .. } => Kind::Hello,
            Frame::Welcome { .. } => Kind::Welcome,
            Frame::Write { .. } => Kind::Write,
            Frame::Read { .. } => Kind::Read,
            Frame::ReadResp { .. } => Kind::ReadResp,
            Frame::Ack { .. } => Kind::Ack,
            Frame::Notify { .. } => Kind::Notify,
            Frame::Heartbeat => Kind::Heartbeat,
            Frame::HeartbeatAck => Kind::HeartbeatAck,
            Frame::Error { .. } => Kind::Error,
            Frame::Bye => Kind::Bye,
            Frame::RegionsQuery => Kind::RegionsQuery,
            Frame::RegionsTable { .. } => Kind::RegionsTable,
            Frame::RegionsUpdate { .. } => Kind::RegionsUpdate,
            Frame::RegionsAck { .. } => Kind::RegionsAck,
            Frame::RegionsDelta { .. } => Kind::RegionsDelta,
            Frame::WriteStrided { .. } => Kind::WriteStrided,
            Frame::ReadStrided { .. } => Kind::ReadStrided,
            Frame::AuthChallenge { .. } => Kind::AuthChallenge,
            Frame::AuthResponse { .. } => Kind::AuthResponse,
            Frame::BackendOpen { .. } => Kind::BackendOpen,
            Frame::BackendOpened { .. } => Kind::BackendOpened,
        }
    }

    /// Bytes of raw data that follow this frame on the stream.
    pub fn bulk_len(&self) -> u64 {
        match self {
            Frame::Write { segs } => segs.iter().map(|s| s.len).sum(),
            Frame::WriteStrided { seg } => seg.bytes().unwrap_or(0),
            _ => 0,
        }
    }
}

/// Sum of segment lengths, or an error on overflow.
pub fn total_len(segs: &[Seg]) -> Result<u64, WireError> {
    segs.iter().try_fold(0u64, |acc, s| {
        acc.checked_add(s.len).ok_or(WireError::Invalid { field: "segment total", value: u64::MAX })
    })
}

/// Encodes `frame` with `tag` into header + payload. For `ReadResp` with status 0,
/// `read_bulk` is the number of bytes that the caller will send after it.
pub fn encode(frame: &Frame, tag: u64, read_bulk: u64) -> Vec<u8> {
    let mut p = Vec::with_capacity(HEADER_LEN + 64);
    p.extend_from_slice(&[0u8; HEADER_LEN]);
    let mut bulk = frame.bulk_len();
    match frame {
        Frame::Hello {
            engine_id,
            host,
            link_nonce,
            stream_index,
            stream_count,
            auth_nonce,
            flags,
            dialled,
        } => {
            put_str(&mut p, engine_id);
            put_str(&mut p, host);
            p.extend_from_slice(&link_nonce.to_le_bytes());
            p.extend_from_slice(&stream_index.to_le_bytes());
            p.extend_from_slice(&stream_count.to_le_bytes());
            p.extend_from_slice(auth_nonce);
            p.extend_from_slice(&flags.to_le_bytes());
            put_str(&mut p, dialled);
        }
        Frame::AuthChallenge { nonce, proof, engine_id } => {
            p.extend_from_slice(nonce);
            p.extend_from_slice(proof);
            put_str(&mut p, engine_id);
        }
        Frame::AuthResponse { proof } => p.extend_from_slice(proof),
        Frame::Welcome { engine_id, host, table_version, capabilities, regions } => {
            put_str(&mut p, engine_id);
            put_str(&mut p, host);
            p.extend_from_slice(&table_version.to_le_bytes());
            put_capabilities(&mut p, capabilities);
            put_regions(&mut p, regions);
        }
        Frame::Write { segs } | Frame::Read { segs } => {
            p.extend_from_slice(&(segs.len() as u32).to_le_bytes());
            for s in segs {
                p.extend_from_slice(&s.addr.to_le_bytes());
                p.extend_from_slice(&s.len.to_le_bytes());
            }
        }
        Frame::ReadResp { status, message } => {
            p.extend_from_slice(&status.to_le_bytes());
            put_str(&mut p, message);
            if *status == 0 {
                bulk = read_bulk;
            }
        }
        Frame::Ack { status, message } | Frame::Error { status, message } => {
            p.extend_from_slice(&status.to_le_bytes());
            put_str(&mut p, message);
        }
        Frame::Notify { name, msg } => {
            put_str(&mut p, name);
            put_str(&mut p, msg);
        }
        Frame::RegionsTable { version, regions } | Frame::RegionsUpdate { version, regions } => {
            p.extend_from_slice(&version.to_le_bytes());
            put_regions(&mut p, regions);
        }
        Frame::RegionsAck { version } => p.extend_from_slice(&version.to_le_bytes()),
        Frame::RegionsDelta { from, version, added, removed } => {
            p.extend_from_slice(&from.to_le_bytes());
            p.extend_from_slice(&version.to_le_bytes());
            put_regions(&mut p, added);
            put_ids(&mut p, removed);
        }
        Frame::WriteStrided { seg } | Frame::ReadStrided { seg } => {
            for v in [seg.addr, seg.count, seg.size, seg.stride] {
                p.extend_from_slice(&v.to_le_bytes());
            }
        }
        Frame::BackendOpen { backend, payload } => {
            p.push(backend.len() as u8);
            p.extend_from_slice(backend.as_bytes());
            p.extend_from_slice(&(payload.len() as u32).to_le_bytes());
            p.extend_from_slice(payload);
        }
        Frame::BackendOpened { status, message, payload } => {
            p.extend_from_slice(&status.to_le_bytes());
            put_str(&mut p, message);
            p.extend_from_slice(&(payload.len() as u32).to_le_bytes());
            p.extend_from_slice(payload);
        }
        Frame::Heartbeat | Frame::HeartbeatAck | Frame::Bye | Frame::RegionsQuery => {}
    }
    let payload_len = (p.len() - HEADER_LEN) as u32;
    let h = Header { kind: frame.kind(), payload_len, tag, bulk_len: bulk };
    p[..HEADER_LEN].copy_from_slice(&encode_header(&h));
    p
}

/// Encodes a header alone.
pub fn encode_header(h: &Header) -> [u8; HEADER_LEN] {
    let mut b = [0u8; HEADER_LEN];
    b[0..2].copy_from_slice(&MAGIC);
    b[2] = VERSION;
    b[3] = h.kind as u8;
    b[4..8].copy_from_slice(&h.payload_len.to_le_bytes());
    b[8..16].copy_from_slice(&h.tag.to_le_bytes());
    b[16..24].copy_from_slice(&h.bulk_len.to_le_bytes());
    b
}

/// Decodes and validates a header.
pub fn decode_header(b: &[u8; HEADER_LEN]) -> Result<Header, WireError> {
    if b[0..2] != MAGIC {
        return Err(WireError::BadMagic([b[0], b[1]]));
    }
    if b[2] != VERSION {
        return Err(WireError::BadVersion(b[2]));
    }
    let kind = Kind::from_u8(b[3])?;
    let payload_len = u32::from_le_bytes(b[4..8].try_into().unwrap());
    if payload_len > max_payload(kind) {
        return Err(WireError::TooLarge {
            field: "payload_len",
            value: payload_len as u64,
            limit: max_payload(kind) as u64,
        });
    }
    let tag = u64::from_le_bytes(b[8..16].try_into().unwrap());
    let bulk_len = u64::from_le_bytes(b[16..24].try_into().unwrap());
    if bulk_len != 0 && !matches!(kind, Kind::Write | Kind::WriteStrided | Kind::ReadResp) {
        return Err(WireError::Invalid { field: "bulk_len", value: bulk_len });
    }
    Ok(Header { kind, payload_len, tag, bulk_len })
}

/// Decodes one whole frame (header + payload) from a buffer; returns the frame, its header and
/// the bytes consumed. Used by tests and the fuzz target; the I/O layer reads in two steps.
pub fn decode(buf: &[u8]) -> Result<(Header, Frame, usize), WireError> {
    let hb: &[u8; HEADER_LEN] =
        buf.get(..HEADER_LEN).ok_or(WireError::Truncated { field: "header" })?.try_into().unwrap();
    let h = decode_header(hb)?;
    let end = HEADER_LEN + h.payload_len as usize;
    let payload = buf.get(HEADER_LEN..end).ok_or(WireError::Truncated { field: "payload" })?;
    Ok((h, decode_payload(&h, payload)?, end))
}

fn put_str(p: &mut Vec<u8>, s: &str) {
    p.extend_from_slice(&(s.len() as u32).to_le_bytes());
    p.extend_from_slice(s.as_bytes());
}

#[cfg(test)]
mod tests;
