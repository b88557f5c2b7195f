//! `disconnect` racing the end of a `connect_async`: whichever wins, the slot must not stay
//! "Connecting" and the link the connect opened must be closed (none outlives its engine).
//! Its own test binary: it counts the threads of this process.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use hixl_core::{ConnectStatus, Engine, Status};

mod threads;
use threads::{settle_to, threads};

#[test]
fn disconnect_racing_connect_async_leaves_no_slot_connecting_and_no_link() {
    let target = Engine::new();
    target.initialize("127.0.0.1:0", &HashMap::new()).unwrap();
    let addr = target.local_engine().unwrap();
    let tcp = HashMap::from([("hixl.backends".to_string(), "tcp".to_string())]);
    let baseline = threads();
    for round in 0..150 {
        let e = Engine::new();
        e.initialize("127.0.0.1", &tcp).unwrap();
        e.connect_async(&addr).unwrap();
        // Disconnect as soon as it is allowed: refused (FAILED) while the connect is under
        // way, so this spins right across the moment the connect thread finishes.
        let deadline = Instant::now() + Duration::from_secs(3);
        let last = loop {
            match e.disconnect(&addr, Duration::ZERO) {
                Err(err) if err.status == Status::Failed && Instant::now() < deadline => continue,
                other => break other,
            }
        };
        let status = e.get_async_connect_status(&addr).unwrap();
        assert_ne!(
            status,
            ConnectStatus::Connecting,
            "round {round}: the slot stays Connecting after the connect ended (last disconnect: {last:?})"
        );
        e.finalize().unwrap();
        drop(e);
        let left = settle_to(baseline);
        assert!(
            left <= baseline,
            "round {round}: {left} threads after finalize, {baseline} before: a link leaked"
        );
    }
    target.finalize().unwrap();
}
