//! Two engines in one process over TCP loopback: the target registers a buffer, the initiator
//! connects, writes into it one-sidedly with a notification, and reads it back.
//!
//! Run: `cargo run --release -p hixl-core --example two_engines`

use std::collections::HashMap;
use std::time::{Duration, Instant};

use hixl_core::{Engine, MemDesc, MemType, NotifyDesc, TransferOp, TransferOpDesc, TransferStatus};

fn main() -> Result<(), hixl_core::Error> {
    let opts = HashMap::new();
    let timeout = Duration::from_secs(5);

    // The target: listens on an ephemeral port and registers 64 MiB. It runs no code per transfer.
    let target = Engine::new();
    target.initialize("127.0.0.1:0", &opts)?;
    let mut remote_buf = vec![0u8; 64 << 20];
    unsafe {
        target.register_mem(
            MemDesc { addr: remote_buf.as_mut_ptr() as u64, len: remote_buf.len() as u64 },
            MemType::Host,
        )
    }?;
    let peer = target.local_engine()?;

    // The initiator: client only.
    let init = Engine::new();
    init.initialize("127.0.0.1", &opts)?;
    let mut local: Vec<u8> = (0..64u32 << 20).map(|i| (i % 251) as u8).collect();
    let h = unsafe {
        init.register_mem(MemDesc { addr: local.as_mut_ptr() as u64, len: local.len() as u64 }, MemType::Host)
    }?;
    init.connect(&peer, timeout)?;
    let remote = init.remote_mems(&peer)?[0];

    // One async WRITE of the whole buffer; the notify arrives after the bytes.
    let t0 = Instant::now();
    let desc = TransferOpDesc { local_addr: h.addr, remote_addr: remote.addr, len: h.len };
    let note = NotifyDesc::new("layer", "0 done");
    let req = init.transfer_async(&peer, TransferOp::Write, &[desc], Some(note), None)?;
    assert_eq!(req.wait(Some(timeout)), TransferStatus::Completed);
    let secs = t0.elapsed().as_secs_f64();
    println!("wrote {} MiB in {:.1} ms ({:.2} GB/s)", h.len >> 20, secs * 1e3, h.len as f64 / secs / 1e9);
    println!("target got notifies: {:?}", target.get_notifies()?);
    assert!(remote_buf == local, "target bytes equal the source");

    // READ it back into a zeroed local buffer.
    local.fill(0);
    init.transfer_sync(&peer, TransferOp::Read, &[desc], timeout)?;
    assert!(remote_buf == local);
    println!("read back and verified; stats: {:?}", init.stats()?);
    init.finalize()?;
    target.finalize()?;
    Ok(())
}
