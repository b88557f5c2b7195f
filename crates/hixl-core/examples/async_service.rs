//! A service on tokio that awaits transfers: two tasks each WRITE half of a buffer into
//! another process's registered memory with `.await`, then one READs it all back, compares,
//! and tells the other process (which checks its own bytes) that it is done.
//!
//!   cargo run --release -p hixl-core --example async_service
//!
//! The example starts its own target: the same binary with the argument `target`.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use hixl_core::{Engine, NotifyDesc, TransferOp, TransferOpDesc};

const SIZE: usize = 1 << 20;

fn checksum(b: &[u8]) -> String {
    let h = b.iter().fold(1469598103934665603u64, |h, c| (h ^ u64::from(*c)).wrapping_mul(1099511628211));
    format!("{h:016x}")
}

/// The target: registers "kv", says where it listens, waits for "done" and checks its bytes.
fn target() -> Result<(), hixl_core::Error> {
    let e = Engine::new();
    e.initialize("127.0.0.1:0", &Default::default())?;
    let kv = e.register_static(Box::leak(vec![0u8; SIZE].into_boxed_slice()), "kv")?;
    println!("READY {}", e.local_engine()?);
    let done = e.wait_notifies(Duration::from_secs(30), Some("done"))?;
    // SAFETY: `kv` was leaked above; the initiator finished writing before it notified.
    let mine = unsafe { std::slice::from_raw_parts(kv.addr as *const u8, SIZE) };
    if done[0].msg != checksum(mine) {
        eprintln!("target: kv holds {}, the initiator wrote {}", checksum(mine), done[0].msg);
        std::process::exit(1);
    }
    e.finalize()
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    if std::env::args().nth(1).as_deref() == Some("target") {
        return Ok(target()?);
    }
    let mut child = Command::new(std::env::current_exe()?).arg("target").stdout(Stdio::piped()).spawn()?;
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("piped")).read_line(&mut line)?;
    let peer = line.trim().strip_prefix("READY ").ok_or("the target did not start")?.to_string();

    let e = std::sync::Arc::new(Engine::new());
    e.initialize("127.0.0.1", &Default::default())?;
    let src: &'static mut [u8] = Box::leak((0..SIZE).map(|i| (i * 13 + 1) as u8).collect());
    let h = e.register_static(src, "src")?;
    let back = e.register_static(Box::leak(vec![0u8; SIZE].into_boxed_slice()), "back")?;
    e.connect(&peer, Duration::from_secs(10))?;
    let kv = e.remote_region(&peer, "kv")?;

    // Two tasks, one half each, both awaiting their request on the one thread of the runtime.
    let half = (SIZE / 2) as u64;
    let mut tasks = Vec::new();
    for i in 0..2u64 {
        let (e, peer) = (e.clone(), peer.clone());
        let d = TransferOpDesc { local_addr: h.addr + i * half, remote_addr: kv.addr + i * half, len: half };
        tasks.push(tokio::spawn(async move {
            let req = e.transfer_async(&peer, TransferOp::Write, &[d], None, None)?;
            req.completion().await
        }));
    }
    for t in tasks {
        t.await??;
    }
    let d = TransferOpDesc { local_addr: back.addr, remote_addr: kv.addr, len: SIZE as u64 };
    e.transfer_async(&peer, TransferOp::Read, &[d], None, None)?.completion().await?;
    // SAFETY: both buffers were leaked above and no transfer into `back` is in flight.
    let (sent, got) = unsafe {
        (
            std::slice::from_raw_parts(h.addr as *const u8, SIZE),
            std::slice::from_raw_parts(back.addr as *const u8, SIZE),
        )
    };
    if sent != got {
        return Err("the bytes read back differ".into());
    }
    let done = NotifyDesc::new("done", checksum(sent));
    e.send_notify(&peer, done, Duration::from_secs(10))?;
    let status = child.wait()?;
    if !status.success() {
        return Err(format!("the target failed: {status}").into());
    }
    e.finalize()?;
    println!("ok: {SIZE} bytes written by two tasks with .await, read back and verified by both processes");
    Ok(())
}
