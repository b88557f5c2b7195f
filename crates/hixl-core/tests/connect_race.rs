//! `connect_async` racing `finalize`: a connect that ends after the engine was finalized must
//! close the link it opened, and `finalize` waits for it, so no thread outlives the engine.
//! Its own test binary: it counts the threads of this process.

use std::collections::HashMap;
use std::time::Duration;

use hixl_core::Engine;

mod threads;
use threads::{settle_to, threads};

#[test]
fn finalize_during_connect_async_leaves_no_thread_behind() {
    let target = Engine::new();
    target.initialize("127.0.0.1:0", &HashMap::new()).unwrap();
    let addr = target.local_engine().unwrap();
    let tcp = HashMap::from([("hixl.backends".to_string(), "tcp".to_string())]);
    // Warm up once (the target's threads for a served link come and go with the link).
    let baseline = threads();
    for round in 0..40 {
        let e = Engine::new();
        e.initialize("127.0.0.1", &tcp).unwrap();
        e.connect_async(&addr).unwrap();
        if round % 2 == 1 {
            // Sometimes let the connect get further before the race.
            std::thread::sleep(Duration::from_micros(200 * (round % 7) as u64));
        }
        e.finalize().unwrap();
        drop(e);
        let left = settle_to(baseline);
        assert!(
            left <= baseline,
            "round {round}: {left} threads after finalize, {baseline} before: a link outlived its engine"
        );
    }
    target.finalize().unwrap();
}
