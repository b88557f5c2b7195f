//! The engine's options, composed: the engine-wide rows of `options::SPECS` and each backend's
//! own rows from the table in `transport::backends`. Options may not import transport (that
//! made an import circle), so this module, above both, is the one place that puts them
//! together; `Options::parse`, `Options::default()` and [`option_keys`] are defined here.

use std::collections::HashMap;
use std::sync::LazyLock;

use crate::error::Result;
use crate::options::{keys_with, Options};
use crate::transport::backends::decls;

impl Default for Options {
    /// Every option at the default of its row, the backends' rows included.
    fn default() -> Self {
        Options::defaults_with(&decls())
    }
}

impl Options {
    /// Parses a string map on top of the defaults, with every backend's rows of this build.
    pub fn parse(map: &HashMap<String, String>) -> Result<Options> {
        Options::parse_with(map, &decls())
    }
}

/// Every accepted key with its default and meaning (engine-wide, then each backend's), for
/// docs and `hixl info`.
pub fn option_keys() -> Vec<(&'static str, &'static str, &'static str)> {
    static KEYS: LazyLock<Vec<(&'static str, &'static str, String)>> = LazyLock::new(|| keys_with(&decls()));
    KEYS.iter().map(|(k, d, m)| (*k, *d, m.as_str())).collect()
}
