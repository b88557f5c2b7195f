//! Staging device memory over `tcp` on a machine without CUDA, end to end over real sockets.
//! Without CUDA nothing can register device memory through the API, so the device regions
//! here are host buffers entered into a registry directly as `cuda:0`: what a peer with a
//! GPU would have. Both sides must then refuse with UNSUPPORTED saying CUDA was not found,
//! move no byte, and leave host-to-host transfers on the same link working.

use std::collections::HashMap;
use std::time::Duration;

use super::Engine;
use crate::{MemDesc, MemType, Status, TransferOp, TransferOpDesc};

const T: Duration = Duration::from_secs(10);

fn engine() -> Engine {
    let e = Engine::new();
    let o: HashMap<String, String> =
        [("hixl.backends", "tcp")].iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    e.initialize("127.0.0.1:0", &o).unwrap();
    e
}

/// Enters `buf` into `e`'s registry as device memory of cuda:0 and tells its peers.
fn as_device(e: &Engine, buf: &[u8]) {
    let r = e.running().unwrap();
    r.registry.register(buf.as_ptr() as u64, buf.len() as u64, MemType::Cuda(0)).unwrap();
    if let Some(s) = &r.server {
        s.publish_regions(None).unwrap();
    }
}

fn register_host(e: &Engine, buf: &[u8]) {
    // SAFETY: the buffers outlive the engines (finalized at the end of the test).
    unsafe { e.register_mem(MemDesc { addr: buf.as_ptr() as u64, len: buf.len() as u64 }, MemType::Host) }
        .unwrap();
}

#[test]
fn without_cuda_device_memory_over_tcp_is_unsupported_on_both_sides() {
    if crate::cuda::info().available {
        eprintln!("skipped: this machine has CUDA (tests/test_cuda_staging.py covers it there)");
        return;
    }
    let n = 1 << 20;
    let (target, init) = (engine(), engine());
    let tdev = vec![7u8; n];
    let thost = vec![0u8; n];
    as_device(&target, &tdev);
    register_host(&target, &thost);
    let ihost: Vec<u8> = (0..n).map(|i| (i % 251) as u8).collect();
    let idev = vec![9u8; n];
    register_host(&init, &ihost);
    as_device(&init, &idev);
    let peer = target.local_engine().unwrap();
    init.connect(&peer, T).unwrap();
    let d = |local: &[u8], remote: &[u8]| {
        [TransferOpDesc {
            local_addr: local.as_ptr() as u64,
            remote_addr: remote.as_ptr() as u64,
            len: n as u64,
        }]
    };

    // Host memory here, device memory there: the target refuses, since staging needs CUDA.
    for op in [TransferOp::Write, TransferOp::Read] {
        let e = init.transfer_sync(&peer, op, &d(&ihost, &tdev), T).unwrap_err();
        assert_eq!(e.status, Status::Unsupported, "{op:?}: {e}");
        assert!(e.message.contains("the target stages device memory over TCP: CUDA was"), "{op:?}: {e}");
    }
    // Device memory here: refused before anything is sent.
    for op in [TransferOp::Write, TransferOp::Read] {
        let e = init.transfer_sync(&peer, op, &d(&idev, &thost), T).unwrap_err();
        assert_eq!(e.status, Status::Unsupported, "{op:?}: {e}");
        assert!(e.message.starts_with("staging device memory over TCP: CUDA was"), "{op:?}: {e}");
    }
    assert!(tdev.iter().all(|b| *b == 7) && thost.iter().all(|b| *b == 0), "no byte moved");
    assert!(idev.iter().all(|b| *b == 9));
    assert!(ihost.iter().enumerate().all(|(i, b)| *b == (i % 251) as u8), "the READ wrote nothing");

    // Host to host on the same link: zero-copy, as before; the failures were counted once each.
    init.transfer_sync(&peer, TransferOp::Write, &d(&ihost, &thost), T).unwrap();
    assert_eq!(thost, ihost);
    let s = init.stats().unwrap().into_iter().find(|s| s.peer == peer).unwrap();
    assert_eq!(s.backend, "tcp");
    // The two refused by the target and the two refused here were counted once each; none is
    // left in flight.
    assert_eq!((s.errors, s.in_flight, s.bytes_write), (4, 0, n as u64), "{s:?}");
    target.finalize().unwrap();
    init.finalize().unwrap();
}
