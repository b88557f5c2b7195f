//! Logging through `tracing`. The engine only emits events (targets `hixl_core::...`); which
//! subscriber shows them is the host program's choice. [`init`] installs hixl's own stderr
//! logger, whose level comes from `HIXL_LOG_LEVEL` (DEBUG | INFO | WARN | ERROR, default
//! WARN) and can be changed at run time; the Python module calls it on import.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Once;

use tracing::Level;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

use crate::error::{Error, Result};

static LEVEL: AtomicU8 = AtomicU8::new(2);
static INIT: Once = Once::new();

fn rank(l: &Level) -> u8 {
    match *l {
        Level::ERROR => 0,
        Level::WARN => 1,
        Level::INFO => 2,
        _ => 3,
    }
}

fn parse(s: &str) -> Option<u8> {
    match s.trim().to_ascii_uppercase().as_str() {
        "ERROR" => Some(0),
        "WARN" | "WARNING" => Some(1),
        "INFO" => Some(2),
        "DEBUG" => Some(3),
        _ => None,
    }
}

/// Installs hixl's stderr logger once, as the global `tracing` subscriber (reading
/// `HIXL_LOG_LEVEL`), unless the program already has one. Never called by the engine itself.
pub fn init() {
    INIT.call_once(|| {
        let lvl = std::env::var("HIXL_LOG_LEVEL").ok().and_then(|v| parse(&v)).unwrap_or(1);
        LEVEL.store(lvl, Ordering::Relaxed);
        let filter = tracing_subscriber::filter::filter_fn(|m| {
            m.target().starts_with("hixl") && rank(m.level()) <= LEVEL.load(Ordering::Relaxed)
        });
        let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr).with_ansi(false);
        // Another global subscriber may exist in a Rust host program: then we log through it.
        let _ = tracing_subscriber::registry().with(fmt.with_filter(filter)).try_init();
    });
}

/// Sets the level: "DEBUG", "INFO", "WARN" or "ERROR".
pub fn set_level(level: &str) -> Result<()> {
    init();
    let l = parse(level).ok_or_else(|| {
        Error::param(format!("log level {level:?} is invalid: expected DEBUG, INFO, WARN or ERROR"))
    })?;
    LEVEL.store(l, Ordering::Relaxed);
    Ok(())
}

/// The current level's name.
pub fn level() -> &'static str {
    ["ERROR", "WARN", "INFO", "DEBUG"][LEVEL.load(Ordering::Relaxed) as usize]
}

use tracing_subscriber::Layer as _;
