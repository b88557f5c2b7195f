//! Thread counting for the race tests that check no thread outlives an engine (each such test
//! is its own binary, so the count is this test's alone).

use std::time::{Duration, Instant};

/// The threads of this process.
pub fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").unwrap().count()
}

/// Waits (bounded) until this process has at most `n` threads; returns the last count.
pub fn settle_to(n: usize) -> usize {
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let now = threads();
        if now <= n || Instant::now() > deadline {
            return now;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}
