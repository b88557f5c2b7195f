//! The engine leaves the choice of a `tracing` subscriber to the host program: creating and
//! running an engine installs none, so the program can still install its own afterwards (its
//! own process: the global subscriber can be set once per process).

use std::collections::HashMap;

#[test]
fn the_engine_installs_no_global_subscriber() {
    let e = hixl_core::Engine::new();
    e.initialize("127.0.0.1:0", &HashMap::new()).unwrap();
    e.finalize().unwrap();
    let mine = tracing_subscriber::fmt().with_writer(std::io::sink).finish();
    assert!(
        tracing::subscriber::set_global_default(mine).is_ok(),
        "the engine installed a global subscriber of its own"
    );
}
