//! The `cuda_ipc` backend's registration key: what a peer needs to open a registered device
//! region in its own process. A legacy IPC handle names a whole allocation (torch's caching
//! allocator packs many tensors into one), so the key is the allocation's handle plus where
//! the region starts in it. Pure encoding and decoding; a key comes from a peer and is checked
//! like any other hostile input.

use crate::wire::Domain;

/// Format byte of a key holding a legacy IPC handle (`cuIpcGetMemHandle`).
const LEGACY_IPC: u8 = 1;
/// Bytes of an encoded key: format, ordinal, handle, offset, allocation length.
pub(crate) const KEY_LEN: usize = 1 + 1 + 64 + 8 + 8;

/// A decoded key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct IpcKey {
    /// The owner's ordinal of the device holding the allocation.
    pub ordinal: u8,
    /// The allocation's IPC handle (also its identity: one handle per allocation).
    pub handle: [u8; 64],
    /// Where the region starts in the allocation.
    pub offset: u64,
    /// The allocation's length.
    pub alloc_len: u64,
}

impl IpcKey {
    /// Its bytes as they travel in the region table.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(KEY_LEN);
        v.push(LEGACY_IPC);
        v.push(self.ordinal);
        v.extend_from_slice(&self.handle);
        v.extend_from_slice(&self.offset.to_le_bytes());
        v.extend_from_slice(&self.alloc_len.to_le_bytes());
        v
    }

    /// Reads a peer's key for a region of `region_len` bytes; Err says what is wrong with it
    /// (length, format, ordinal, or a region that does not fit in the allocation).
    pub(crate) fn decode(b: &[u8], region_len: u64) -> Result<IpcKey, String> {
        if b.len() != KEY_LEN {
            return Err(format!("cuda_ipc key has {} bytes, expected {KEY_LEN}", b.len()));
        }
        if b[0] != LEGACY_IPC {
            return Err(format!("cuda_ipc key format {} is not known (expected {LEGACY_IPC})", b[0]));
        }
        let ordinal = b[1];
        if ordinal > Domain::MAX_CUDA_ORDINAL {
            return Err(format!(
                "cuda_ipc key names device ordinal {ordinal}, above {}",
                Domain::MAX_CUDA_ORDINAL
            ));
        }
        let mut handle = [0u8; 64];
        handle.copy_from_slice(&b[2..66]);
        let offset = u64::from_le_bytes(b[66..74].try_into().expect("8 bytes"));
        let alloc_len = u64::from_le_bytes(b[74..82].try_into().expect("8 bytes"));
        match offset.checked_add(region_len) {
            Some(end) if region_len > 0 && end <= alloc_len => {}
            _ => {
                return Err(format!(
                    "cuda_ipc key places a region of {region_len} bytes at offset {offset} of an allocation of {alloc_len}"
                ))
            }
        }
        Ok(IpcKey { ordinal, handle, offset, alloc_len })
    }

    /// Checks a region of `region_len` bytes at this key's offset against the allocation the
    /// driver opened for its handle (`opened_len` bytes from the opened address on, from
    /// `cuMemGetAddressRange`): the key's `alloc_len` is the peer's claim, the driver's length
    /// is what a copy may touch.
    pub(crate) fn check_opened(&self, region_len: u64, opened_len: u64) -> Result<(), String> {
        match self.offset.checked_add(region_len) {
            Some(end) if end <= opened_len => Ok(()),
            _ => Err(format!(
                "cuda_ipc key places a region of {region_len} bytes at offset {} of an allocation it says \
                 holds {} bytes, but the driver opened {opened_len} bytes for its handle",
                self.offset, self.alloc_len
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_region_must_fit_in_what_the_driver_opened() {
        // Not run on a GPU: the bounds only (the driver's length is an argument here).
        let k = IpcKey { ordinal: 0, handle: [0; 64], offset: 4096, alloc_len: 1 << 30 };
        assert!(k.check_opened(4096, 8192).is_ok(), "exactly to the end");
        let e = k.check_opened(4097, 8192).unwrap_err();
        assert!(e.contains("4097 bytes at offset 4096") && e.contains("driver opened 8192"), "{e}");
        assert!(e.contains(&(1u64 << 30).to_string()), "names the claimed length: {e}");
        let far = IpcKey { offset: u64::MAX, ..k };
        assert!(far.check_opened(1, u64::MAX).is_err(), "no overflow");
    }

    fn sample() -> IpcKey {
        let mut handle = [0u8; 64];
        for (i, b) in handle.iter_mut().enumerate() {
            *b = i as u8 ^ 0x5a;
        }
        IpcKey { ordinal: 3, handle, offset: 4096, alloc_len: 2 << 20 }
    }

    #[test]
    fn round_trip() {
        let k = sample();
        let b = k.encode();
        assert_eq!(b.len(), KEY_LEN);
        assert!(b.len() <= crate::wire::MAX_KEY_LEN);
        assert_eq!(IpcKey::decode(&b, 8192).unwrap(), k);
        // The region may end exactly at the allocation's end.
        assert_eq!(IpcKey::decode(&b, (2 << 20) - 4096).unwrap(), k);
    }

    #[test]
    fn hostile_keys_are_refused_with_the_reason() {
        let b = sample().encode();
        assert!(IpcKey::decode(&b[..81], 1).unwrap_err().contains("81 bytes"));
        let mut longer = b.clone();
        longer.push(0);
        assert!(IpcKey::decode(&longer, 1).unwrap_err().contains("83 bytes"));
        let mut fmt = b.clone();
        fmt[0] = 9;
        assert!(IpcKey::decode(&fmt, 1).unwrap_err().contains("format 9"));
        let mut ord = b.clone();
        ord[1] = 200;
        assert!(IpcKey::decode(&ord, 1).unwrap_err().contains("ordinal 200"));
        // Past the allocation's end, an empty region, and an offset that wraps around.
        assert!(IpcKey::decode(&b, (2 << 20) - 4095).unwrap_err().contains("offset 4096"));
        assert!(IpcKey::decode(&b, 0).is_err());
        let wrap = IpcKey { offset: u64::MAX - 1, alloc_len: u64::MAX, ..sample() }.encode();
        assert!(IpcKey::decode(&wrap, 4).is_err());
    }
}
