//! Decoding a frame's payload: every field and every length is checked against its limit
//! before anything is allocated for it.

use super::*;

/// Decodes the payload of a frame whose header was already decoded. Checks that data frames'
/// `bulk_len` matches their descriptors.
pub fn decode_payload(h: &Header, payload: &[u8]) -> Result<Frame, WireError> {
    if payload.len() != h.payload_len as usize {
        return Err(WireError::Truncated { field: "payload" });
    }
    let mut r = Reader { b: payload };
    let frame = match h.kind {
        Kind::Hello => Frame::Hello {
            engine_id: r.name("engine_id")?,
            host: r.name("host")?,
            link_nonce: r.u64("link_nonce")?,
            stream_index: r.u16("stream_index")?,
            stream_count: r.u16("stream_count")?,
            auth_nonce: r.bytes32("auth_nonce")?,
            flags: match r.u32("flags")? {
                f if f & !KNOWN_FLAGS == 0 => f,
                f => return Err(WireError::Invalid { field: "hello flags", value: f as u64 }),
            },
            dialled: r.name("dialled")?,
        },
        Kind::AuthChallenge => Frame::AuthChallenge {
            nonce: r.bytes32("auth nonce")?,
            proof: r.bytes32("auth proof")?,
            engine_id: r.name("engine_id")?,
        },
        Kind::AuthResponse => Frame::AuthResponse { proof: r.bytes32("auth proof")? },
        Kind::Welcome => Frame::Welcome {
            engine_id: r.name("engine_id")?,
            host: r.name("host")?,
            table_version: r.u64("table_version")?,
            capabilities: r.capabilities()?,
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
        Kind::RegionsDelta => {
            let (from, version) = (r.u64("from version")?, r.u64("version")?);
            if from >= version {
                return Err(WireError::Invalid { field: "delta from version", value: from });
            }
            Frame::RegionsDelta { from, version, added: r.regions()?, removed: r.ids()? }
        }
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
        Kind::BackendOpen => {
            let backend = r.backend_name("open backend")?;
            Frame::BackendOpen { backend, payload: r.blob("open payload", MAX_BACKEND_PAYLOAD)? }
        }
        Kind::BackendOpened => {
            let (status, message) = (r.u32("status")?, r.str("message", MAX_MSG)?);
            let payload = r.blob("opened payload", MAX_BACKEND_PAYLOAD)?;
            if status != 0 && !payload.is_empty() {
                return Err(WireError::Invalid { field: "opened payload", value: payload.len() as u64 });
            }
            Frame::BackendOpened { status, message, payload }
        }
    };
    if !r.b.is_empty() {
        return Err(WireError::Trailing(r.b.len()));
    }
    Ok(frame)
}

pub(crate) struct Reader<'a> {
    pub(super) b: &'a [u8],
}

impl<'a> Reader<'a> {
    pub(super) fn take(&mut self, n: usize, field: &'static str) -> Result<&'a [u8], WireError> {
        if self.b.len() < n {
            return Err(WireError::Truncated { field });
        }
        let (h, t) = self.b.split_at(n);
        self.b = t;
        Ok(h)
    }
    pub(super) fn u8(&mut self, f: &'static str) -> Result<u8, WireError> {
        Ok(self.take(1, f)?[0])
    }
    pub(super) fn u16(&mut self, f: &'static str) -> Result<u16, WireError> {
        Ok(u16::from_le_bytes(self.take(2, f)?.try_into().unwrap()))
    }
    pub(super) fn u32(&mut self, f: &'static str) -> Result<u32, WireError> {
        Ok(u32::from_le_bytes(self.take(4, f)?.try_into().unwrap()))
    }
    pub(super) fn u64(&mut self, f: &'static str) -> Result<u64, WireError> {
        Ok(u64::from_le_bytes(self.take(8, f)?.try_into().unwrap()))
    }
    pub(super) fn bytes32(&mut self, f: &'static str) -> Result<[u8; 32], WireError> {
        Ok(self.take(32, f)?.try_into().unwrap())
    }
    /// Length-prefixed (u32) bytes of at most `limit`.
    pub(super) fn blob(&mut self, f: &'static str, limit: usize) -> Result<Vec<u8>, WireError> {
        let n = self.u32(f)? as usize;
        if n > limit {
            return Err(WireError::TooLarge { field: f, value: n as u64, limit: limit as u64 });
        }
        Ok(self.take(n, f)?.to_vec())
    }
    /// An engine id, host name or dialled address: UTF-8 of at most MAX_NAME bytes without
    /// control characters.
    pub(super) fn name(&mut self, f: &'static str) -> Result<String, WireError> {
        let s = self.str(f, MAX_NAME)?;
        match s.char_indices().find(|(_, c)| c.is_control()) {
            Some((at, _)) => Err(WireError::Control { field: f, at }),
            None => Ok(s),
        }
    }

    pub(super) fn str(&mut self, f: &'static str, limit: usize) -> Result<String, WireError> {
        let n = self.u32(f)? as usize;
        if n > limit {
            return Err(WireError::TooLarge { field: f, value: n as u64, limit: limit as u64 });
        }
        let b = self.take(n, f)?;
        String::from_utf8(b.to_vec()).map_err(|_| WireError::Utf8 { field: f })
    }
}
