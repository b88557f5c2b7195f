//! What each backend declares about itself (its name, reach, domains, CLI presence, bench
//! baseline and option rows), and `hixl.backends`' help made from those declarations.

use super::OptionSpec;

/// What a backend declares about itself, in its own module (`DECL` at the top of each module
/// under `transport::backends`); the table there lists them in the order of `auto`.
/// `hixl.backends`' help, `BUILT`, `by_name`, the backend's option rows, the README's backend
/// table and Python's `hixl.backends()` all come from these.
pub struct BackendDecl {
    /// Its name, as `hixl.backends` and `stats()` spell it.
    pub name: &'static str,
    /// What it reaches, in a few words (`hixl.backends`' help: "same host").
    pub meaning: &'static str,
    /// Which engines it can serve.
    pub reach: Reach,
    /// The memory it moves, as text ("host", "host, cuda").
    pub domains: &'static str,
    /// When `auto` offers it, if not always ("only where CUDA is found"; empty: always).
    pub offered: &'static str,
    /// Whether the CLI offers it in its transport lists (`hixl bench`, `hixl demo`).
    pub cli: bool,
    /// What `hixl bench` measures it against (empty: nothing).
    pub baseline: &'static str,
    /// Its own options (`hixl.NAME.*`), in the order `hixl info` lists them.
    pub options: &'static [OptionSpec],
    /// What this host tells about it without a peer, for `hixl info` (`no_host_facts` when
    /// nothing).
    pub host_facts: fn() -> HostFacts,
}

/// Which engines a backend can serve.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reach {
    /// Engines of this process only.
    Process,
    /// Engines of this host, this process's included.
    Host,
    /// Engines on any host the network reaches.
    Network,
}

impl Reach {
    /// Its name in `hixl.backends()`: "process", "host" or "network".
    pub fn as_str(self) -> &'static str {
        match self {
            Reach::Process => "process",
            Reach::Host => "host",
            Reach::Network => "network",
        }
    }
}

/// What a backend finds out about this host without connecting to a peer (`hixl info`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HostFacts {
    /// Whether it is usable here, when that is known without a peer (a device found or not);
    /// None: only a connection tells.
    pub usable: Option<bool>,
    /// A remark for its row (empty: none).
    pub note: String,
}

/// The `host_facts` of a backend with nothing to tell.
pub fn no_host_facts() -> HostFacts {
    HostFacts::default()
}

/// `hixl.backends`' meaning, made from the declarations in the order of `auto`.
pub fn backends_help(decls: &[&BackendDecl]) -> String {
    let names: Vec<&str> = decls.iter().map(|d| d.name).collect();
    let offered: Vec<String> = decls
        .iter()
        .filter(|d| !d.offered.is_empty())
        .enumerate()
        .map(|(i, d)| format!("{} {}{}", d.name, if i == 0 { "is offered " } else { "" }, d.offered))
        .collect();
    let listed: Vec<String> = decls.iter().map(|d| format!("{} ({})", d.name, d.meaning)).collect();
    let offered = if offered.is_empty() { String::new() } else { format!("; {}", offered.join(", ")) };
    format!(
        "backends that may carry data, tried in this order: auto (= {}{offered}) or a list of {}",
        names.join(","),
        listed.join(", ")
    )
}
