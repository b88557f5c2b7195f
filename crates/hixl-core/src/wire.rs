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

/// Frame magic.
pub const MAGIC: [u8; 2] = *b"HX";
/// Protocol version; a peer with another version is refused at the handshake.
pub const VERSION: u8 = 3;
/// Size of the fixed header.
pub const HEADER_LEN: usize = 24;
/// Most descriptors in one data frame.
pub const MAX_DESCS: usize = 1 << 16;
/// Largest payload (descriptor table, strings) of any frame.
pub const MAX_PAYLOAD: u32 = 4 << 20;
/// Longest engine id / notify name in bytes.
pub const MAX_NAME: usize = 1024;
/// Longest notify message / error message in bytes.
pub const MAX_MSG: usize = 1 << 20;
/// Bytes of one region-table entry on the wire.
pub const REGION_ENTRY_LEN: usize = 32;
/// Most regions in a region table.
pub const MAX_REGIONS: usize = (MAX_PAYLOAD as usize - 64 - 3 * MAX_NAME) / REGION_ENTRY_LEN;
/// Hello flag: MAC every frame's bulk bytes too (sealed streams only).
pub const FLAG_DATA_MAC: u32 = 1;
/// Every Hello flag this version knows.
pub const KNOWN_FLAGS: u32 = FLAG_DATA_MAC;
/// Largest Hello payload: two names, the dialled address and the fixed fields.
pub const MAX_HELLO: u32 = 4096;

/// The largest payload a frame of `kind` may declare; checked on the header, before any payload
/// byte is read or any memory is set aside for it.
pub const fn max_payload(kind: Kind) -> u32 {
    let msg = 8 + MAX_MSG as u32;
    match kind {
        Kind::Hello => MAX_HELLO,
        Kind::Welcome | Kind::RegionsTable | Kind::RegionsUpdate => MAX_PAYLOAD,
        Kind::Write | Kind::Read => 4 + 16 * MAX_DESCS as u32,
        Kind::ReadResp | Kind::Ack | Kind::Error => msg,
        Kind::Notify => msg + MAX_NAME as u32,
        Kind::Heartbeat | Kind::HeartbeatAck | Kind::Bye | Kind::RegionsQuery => 0,
        Kind::RegionsAck => 8,
        Kind::WriteStrided | Kind::ReadStrided => 32,
        Kind::AuthChallenge => 68 + MAX_NAME as u32,
        Kind::AuthResponse => 32,
    }
}

/// One registered region as peers see it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RegionEntry {
    /// Start address in the owner's address space.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// The owner's registry id (never reused within one engine).
    pub id: u64,
    /// For engine-allocated shared memory: the owner's memfd descriptor, which a same-host
    /// peer may open through /proc and map; -1 otherwise.
    pub fd: i32,
    /// False for regions registered read-only (`access="r"`): peers may READ, not WRITE.
    pub writable: bool,
}

/// What went wrong while decoding; the I/O layer treats it as a protocol violation.
#[derive(Clone, Debug, PartialEq, Eq)]
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
}

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WireError::BadMagic(m) => write!(f, "bad frame magic {m:?}"),
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
    /// only; `local_socket` names the abstract Unix socket where a same-host initiator proves
    /// that this very process accepted its stream (empty: none); `table_version` is the
    /// version of `regions`.
    Welcome {
        engine_id: String,
        host: String,
        local_socket: String,
        table_version: u64,
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
    /// See [`Kind::WriteStrided`].
    WriteStrided { seg: StridedSeg },
    /// See [`Kind::ReadStrided`].
    ReadStrided { seg: StridedSeg },
    /// See [`Kind::AuthChallenge`]; `engine_id` is the target's, bound into the proofs.
    AuthChallenge { nonce: [u8; 32], proof: [u8; 32], engine_id: String },
    /// See [`Kind::AuthResponse`].
    AuthResponse { proof: [u8; 32] },
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
            Frame::WriteStrided { .. } => Kind::WriteStrided,
            Frame::ReadStrided { .. } => Kind::ReadStrided,
            Frame::AuthChallenge { .. } => Kind::AuthChallenge,
            Frame::AuthResponse { .. } => Kind::AuthResponse,
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
        Frame::Welcome { engine_id, host, local_socket, table_version, regions } => {
            put_str(&mut p, engine_id);
            put_str(&mut p, host);
            put_str(&mut p, local_socket);
            p.extend_from_slice(&table_version.to_le_bytes());
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
        Frame::WriteStrided { seg } | Frame::ReadStrided { seg } => {
            for v in [seg.addr, seg.count, seg.size, seg.stride] {
                p.extend_from_slice(&v.to_le_bytes());
            }
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

/// Decodes the payload of a frame whose header was already decoded. Checks that data frames'
/// `bulk_len` matches their descriptors.
pub fn decode_payload(h: &Header, payload: &[u8]) -> Result<Frame, WireError> {
    if payload.len() != h.payload_len as usize {
        return Err(WireError::Truncated { field: "payload" });
    }
    let mut r = Reader { b: payload };
    let frame = match h.kind {
        Kind::Hello => Frame::Hello {
            engine_id: r.str("engine_id", MAX_NAME)?,
            host: r.str("host", MAX_NAME)?,
            link_nonce: r.u64("link_nonce")?,
            stream_index: r.u16("stream_index")?,
            stream_count: r.u16("stream_count")?,
            auth_nonce: r.bytes32("auth_nonce")?,
            flags: match r.u32("flags")? {
                f if f & !KNOWN_FLAGS == 0 => f,
                f => return Err(WireError::Invalid { field: "hello flags", value: f as u64 }),
            },
            dialled: r.str("dialled", MAX_NAME)?,
        },
        Kind::AuthChallenge => Frame::AuthChallenge {
            nonce: r.bytes32("auth nonce")?,
            proof: r.bytes32("auth proof")?,
            engine_id: r.str("engine_id", MAX_NAME)?,
        },
        Kind::AuthResponse => Frame::AuthResponse { proof: r.bytes32("auth proof")? },
        Kind::Welcome => Frame::Welcome {
            engine_id: r.str("engine_id", MAX_NAME)?,
            host: r.str("host", MAX_NAME)?,
            local_socket: r.str("local_socket", MAX_NAME)?,
            table_version: r.u64("table_version")?,
            regions: r.regions()?,
        },
        Kind::Write | Kind::Read => {
            let n = r.u32("segment count")? as usize;
            if n > MAX_DESCS {
                return Err(WireError::TooLarge {
                    field: "segment count",
                    value: n as u64,
                    limit: MAX_DESCS as u64,
                });
            }
            if r.b.len() != n * 16 {
                return Err(WireError::Truncated { field: "segments" });
            }
            let mut segs = Vec::with_capacity(n);
            for _ in 0..n {
                let addr = r.u64("segment addr")?;
                let len = r.u64("segment len")?;
                if len == 0 {
                    return Err(WireError::Invalid { field: "segment len", value: 0 });
                }
                if addr.checked_add(len).is_none() {
                    return Err(WireError::Invalid { field: "segment addr", value: addr });
                }
                segs.push(Seg { addr, len });
            }
            let total = total_len(&segs)?;
            let expect = if h.kind == Kind::Write { total } else { 0 };
            if h.bulk_len != expect {
                return Err(WireError::Invalid { field: "bulk_len", value: h.bulk_len });
            }
            if h.kind == Kind::Write {
                Frame::Write { segs }
            } else {
                Frame::Read { segs }
            }
        }
        Kind::ReadResp => {
            let status = r.u32("status")?;
            let message = r.str("message", MAX_MSG)?;
            if status != 0 && h.bulk_len != 0 {
                return Err(WireError::Invalid { field: "bulk_len", value: h.bulk_len });
            }
            Frame::ReadResp { status, message }
        }
        Kind::Ack => Frame::Ack { status: r.u32("status")?, message: r.str("message", MAX_MSG)? },
        Kind::Error => Frame::Error { status: r.u32("status")?, message: r.str("message", MAX_MSG)? },
        Kind::Notify => {
            Frame::Notify { name: r.str("notify name", MAX_NAME)?, msg: r.str("notify msg", MAX_MSG)? }
        }
        Kind::Heartbeat => Frame::Heartbeat,
        Kind::HeartbeatAck => Frame::HeartbeatAck,
        Kind::Bye => Frame::Bye,
        Kind::RegionsQuery => Frame::RegionsQuery,
        Kind::RegionsTable => Frame::RegionsTable { version: r.u64("version")?, regions: r.regions()? },
        Kind::RegionsUpdate => Frame::RegionsUpdate { version: r.u64("version")?, regions: r.regions()? },
        Kind::RegionsAck => Frame::RegionsAck { version: r.u64("version")? },
        Kind::WriteStrided | Kind::ReadStrided => {
            let seg = StridedSeg {
                addr: r.u64("strided addr")?,
                count: r.u64("strided count")?,
                size: r.u64("strided size")?,
                stride: r.u64("strided stride")?,
            };
            if seg.count == 0 {
                return Err(WireError::Invalid { field: "strided count", value: 0 });
            }
            if seg.size == 0 {
                return Err(WireError::Invalid { field: "strided size", value: 0 });
            }
            if seg.stride < seg.size {
                return Err(WireError::Invalid { field: "strided stride", value: seg.stride });
            }
            let (Some(bytes), Some(span)) = (seg.bytes(), seg.span()) else {
                return Err(WireError::Invalid { field: "strided count", value: seg.count });
            };
            if seg.addr.checked_add(span).is_none() {
                return Err(WireError::Invalid { field: "strided addr", value: seg.addr });
            }
            let expect = if h.kind == Kind::WriteStrided { bytes } else { 0 };
            if h.bulk_len != expect {
                return Err(WireError::Invalid { field: "bulk_len", value: h.bulk_len });
            }
            if h.kind == Kind::WriteStrided {
                Frame::WriteStrided { seg }
            } else {
                Frame::ReadStrided { seg }
            }
        }
    };
    if !r.b.is_empty() {
        return Err(WireError::Trailing(r.b.len()));
    }
    Ok(frame)
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

fn put_regions(p: &mut Vec<u8>, regions: &[RegionEntry]) {
    p.extend_from_slice(&(regions.len() as u32).to_le_bytes());
    for r in regions {
        p.extend_from_slice(&r.addr.to_le_bytes());
        p.extend_from_slice(&r.len.to_le_bytes());
        p.extend_from_slice(&r.id.to_le_bytes());
        p.extend_from_slice(&r.fd.to_le_bytes());
        p.extend_from_slice(&u32::from(r.writable).to_le_bytes());
    }
}

struct Reader<'a> {
    b: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, field: &'static str) -> Result<&'a [u8], WireError> {
        if self.b.len() < n {
            return Err(WireError::Truncated { field });
        }
        let (h, t) = self.b.split_at(n);
        self.b = t;
        Ok(h)
    }
    fn u16(&mut self, f: &'static str) -> Result<u16, WireError> {
        Ok(u16::from_le_bytes(self.take(2, f)?.try_into().unwrap()))
    }
    fn u32(&mut self, f: &'static str) -> Result<u32, WireError> {
        Ok(u32::from_le_bytes(self.take(4, f)?.try_into().unwrap()))
    }
    fn u64(&mut self, f: &'static str) -> Result<u64, WireError> {
        Ok(u64::from_le_bytes(self.take(8, f)?.try_into().unwrap()))
    }
    fn bytes32(&mut self, f: &'static str) -> Result<[u8; 32], WireError> {
        Ok(self.take(32, f)?.try_into().unwrap())
    }
    fn str(&mut self, f: &'static str, limit: usize) -> Result<String, WireError> {
        let n = self.u32(f)? as usize;
        if n > limit {
            return Err(WireError::TooLarge { field: f, value: n as u64, limit: limit as u64 });
        }
        let b = self.take(n, f)?;
        String::from_utf8(b.to_vec()).map_err(|_| WireError::Utf8 { field: f })
    }
    fn regions(&mut self) -> Result<Vec<RegionEntry>, WireError> {
        let n = self.u32("region count")? as usize;
        if n > MAX_REGIONS || self.b.len() < n * REGION_ENTRY_LEN {
            return Err(if n > MAX_REGIONS {
                WireError::TooLarge { field: "region count", value: n as u64, limit: MAX_REGIONS as u64 }
            } else {
                WireError::Truncated { field: "regions" }
            });
        }
        let mut v = Vec::with_capacity(n);
        for _ in 0..n {
            let addr = self.u64("region addr")?;
            let len = self.u64("region len")?;
            let id = self.u64("region id")?;
            let fd = self.u32("region fd")? as i32;
            let writable = match self.u32("region flags")? {
                0 => false,
                1 => true,
                other => return Err(WireError::Invalid { field: "region flags", value: other as u64 }),
            };
            if len == 0 || addr.checked_add(len).is_none() {
                return Err(WireError::Invalid { field: "region", value: addr });
            }
            if fd < -1 {
                return Err(WireError::Invalid { field: "region fd", value: fd as u64 });
            }
            v.push(RegionEntry { addr, len, id, fd, writable });
        }
        Ok(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn seg() -> impl Strategy<Value = Seg> {
        (0u64..u64::MAX / 2, 1u64..1 << 40).prop_map(|(addr, len)| Seg { addr, len })
    }

    fn frame() -> impl Strategy<Value = Frame> {
        let s = "[a-zA-Z0-9:._ -]{0,40}";
        let regions = prop::collection::vec(
            (1u64..1 << 48, 1u64..1 << 30, any::<u64>(), -1i32..1000, any::<bool>())
                .prop_map(|(addr, len, id, fd, writable)| RegionEntry { addr, len, id, fd, writable }),
            0..20,
        );
        prop_oneof![
            (s, any::<u64>(), any::<u16>(), any::<u16>(), any::<[u8; 32]>(), 0..=KNOWN_FLAGS).prop_map(
                |(e, n, i, c, a, flags)| Frame::Hello {
                    host: e.chars().rev().collect(),
                    dialled: format!("{e}:1"),
                    engine_id: e,
                    link_nonce: n,
                    stream_index: i,
                    stream_count: c,
                    auth_nonce: a,
                    flags,
                }
            ),
            (any::<[u8; 32]>(), any::<[u8; 32]>(), s)
                .prop_map(|(nonce, proof, engine_id)| Frame::AuthChallenge { nonce, proof, engine_id }),
            any::<[u8; 32]>().prop_map(|proof| Frame::AuthResponse { proof }),
            (s, s, s, any::<u64>(), regions.clone()).prop_map(|(e, host, sock, v, regions)| {
                Frame::Welcome { engine_id: e, host, local_socket: sock, table_version: v, regions }
            }),
            prop::collection::vec(seg(), 0..50).prop_map(|segs| Frame::Write { segs }),
            prop::collection::vec(seg(), 0..50).prop_map(|segs| Frame::Read { segs }),
            (1u32.., s).prop_map(|(status, message)| Frame::ReadResp { status, message }),
            (any::<u32>(), s).prop_map(|(status, message)| Frame::Ack { status, message }),
            (any::<u32>(), s).prop_map(|(status, message)| Frame::Error { status, message }),
            (s, s).prop_map(|(name, msg)| Frame::Notify { name, msg }),
            Just(Frame::Heartbeat),
            Just(Frame::HeartbeatAck),
            Just(Frame::Bye),
            Just(Frame::RegionsQuery),
            (any::<u64>(), regions.clone())
                .prop_map(|(version, regions)| Frame::RegionsTable { version, regions }),
            (any::<u64>(), regions).prop_map(|(version, regions)| Frame::RegionsUpdate { version, regions }),
            any::<u64>().prop_map(|version| Frame::RegionsAck { version }),
            (1u64..1 << 40, 1u64..1 << 20, 1u64..1 << 12, 0u64..1 << 12).prop_map(
                |(addr, count, size, pad)| {
                    Frame::WriteStrided { seg: StridedSeg { addr, count, size, stride: size + pad } }
                }
            ),
            (1u64..1 << 40, 1u64..1 << 20, 1u64..1 << 12, 0u64..1 << 12).prop_map(
                |(addr, count, size, pad)| {
                    Frame::ReadStrided { seg: StridedSeg { addr, count, size, stride: size + pad } }
                }
            ),
        ]
    }

    proptest! {
        #[test]
        fn round_trip(f in frame(), tag in any::<u64>()) {
            let buf = encode(&f, tag, 0);
            let (h, g, used) = decode(&buf).unwrap();
            prop_assert_eq!(used, buf.len());
            prop_assert_eq!(h.tag, tag);
            prop_assert_eq!(h.bulk_len, f.bulk_len());
            prop_assert_eq!(g, f);
        }

        #[test]
        fn truncation_is_rejected(f in frame(), cut in 0usize..1000) {
            let buf = encode(&f, 1, 0);
            let cut = cut % buf.len();
            prop_assert!(decode(&buf[..cut]).is_err());
        }

        #[test]
        fn random_bytes_never_panic(b in prop::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode(&b);
        }

        #[test]
        fn mutated_frames_never_panic(f in frame(), i in any::<usize>(), v in any::<u8>()) {
            let mut buf = encode(&f, 7, 0);
            let i = i % buf.len();
            buf[i] = v;
            let _ = decode(&buf);
        }
    }

    #[test]
    fn oversized_fields_are_rejected() {
        let mut h = encode_header(&Header { kind: Kind::Write, payload_len: 0, tag: 0, bulk_len: 0 });
        h[4..8].copy_from_slice(&(MAX_PAYLOAD + 1).to_le_bytes());
        assert!(matches!(decode_header(&h), Err(WireError::TooLarge { field: "payload_len", .. })));
        // Each kind has its own cap: a Hello may not declare more than MAX_HELLO.
        let hello =
            encode_header(&Header { kind: Kind::Hello, payload_len: MAX_HELLO + 1, tag: 0, bulk_len: 0 });
        assert!(
            matches!(decode_header(&hello), Err(WireError::TooLarge { limit, .. }) if limit == MAX_HELLO as u64)
        );
        let hb = encode_header(&Header { kind: Kind::Heartbeat, payload_len: 1, tag: 0, bulk_len: 0 });
        assert!(decode_header(&hb).is_err(), "a heartbeat has no payload");
        let mut buf = encode(&Frame::Read { segs: vec![] }, 0, 0);
        buf[HEADER_LEN..HEADER_LEN + 4].copy_from_slice(&((MAX_DESCS + 1) as u32).to_le_bytes());
        assert!(matches!(decode(&buf), Err(WireError::TooLarge { field: "segment count", .. })));
        let mut v = encode(&Frame::Heartbeat, 0, 0);
        v[2] = 9;
        assert_eq!(decode(&v).unwrap_err(), WireError::BadVersion(9));
        let w = encode(&Frame::Write { segs: vec![Seg { addr: 1, len: 4 }] }, 0, 0);
        let (h, _, _) = decode(&w).unwrap();
        assert_eq!(h.bulk_len, 4);
        let mut bad = w.clone();
        bad[16..24].copy_from_slice(&5u64.to_le_bytes());
        assert!(decode(&bad).is_err(), "bulk_len must match the segments");
        let zero = encode(&Frame::Write { segs: vec![Seg { addr: 1, len: 0 }] }, 0, 0);
        assert!(decode(&zero).is_err(), "zero-length segment");
        let wrap = encode(&Frame::Read { segs: vec![Seg { addr: u64::MAX, len: 2 }] }, 0, 0);
        assert!(decode(&wrap).is_err(), "wrapping segment");
    }
}
