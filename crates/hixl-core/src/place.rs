//! Where hixl's threads run. An engine captures a CPU set at `initialize` (`hixl.cpus` or
//! `HIXL_CPUS`, else the CPUs the initializing thread may run on) and every thread hixl
//! starts, then or later, pins itself to that set first: a thread started lazily never
//! inherits the mask of whichever caller happened to start it (an inference engine that pins
//! its main thread to one core after `initialize` would otherwise get hixl's copy threads on
//! that core too). Threads a hixl thread starts take its set; threads started from a caller's
//! thread take the set of the engine that was initialized last (or their engine's, where the
//! code knows it: `spawn_on`).

use std::cell::RefCell;
use std::sync::{Arc, RwLock};
use std::thread::JoinHandle;

use crate::error::{Error, Result};
use crate::sys::affinity;

/// The environment variable read when the options give no `hixl.cpus`.
pub const CPUS_ENV: &str = "HIXL_CPUS";

/// A CPU set, ascending.
pub type Cpus = Arc<[usize]>;

/// The set of the engine initialized last (for threads started outside any engine's reach).
static LAST: RwLock<Option<Cpus>> = RwLock::new(None);

thread_local! {
    /// The set the calling hixl thread was pinned to (None on the caller's threads).
    static MINE: RefCell<Option<Cpus>> = const { RefCell::new(None) };
}

/// Parses a CPU list ("0-3,6"): ascending, without repeats.
pub fn parse_list(text: &str) -> Option<Vec<usize>> {
    let mut out = Vec::new();
    for part in text.split(',').map(str::trim) {
        let (lo, hi) = match part.split_once('-') {
            Some((a, b)) => (a.trim().parse::<usize>().ok()?, b.trim().parse::<usize>().ok()?),
            None => {
                let c = part.parse::<usize>().ok()?;
                (c, c)
            }
        };
        if lo > hi || hi >= libc::CPU_SETSIZE as usize {
            return None;
        }
        out.extend(lo..=hi);
    }
    out.sort_unstable();
    out.dedup();
    (!out.is_empty()).then_some(out)
}

/// Writes a CPU set as a list ("0-3,6").
pub fn format_list(cpus: &[usize]) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut i = 0;
    while i < cpus.len() {
        let mut j = i;
        while j + 1 < cpus.len() && cpus[j + 1] == cpus[j] + 1 {
            j += 1;
        }
        parts.push(if i == j { cpus[i].to_string() } else { format!("{}-{}", cpus[i], cpus[j]) });
        i = j + 1;
    }
    parts.join(",")
}

/// The engine's CPU set at `initialize`: `option` (`hixl.cpus`; else `HIXL_CPUS`), which
/// must be a CPU list inside the calling thread's allowed set, or that allowed set. It
/// becomes the set of threads started outside an engine's reach.
pub(crate) fn capture(option: Option<&str>) -> Result<Cpus> {
    let allowed = affinity::current().map_err(|e| Error::failed(format!("sched_getaffinity: {e}")))?;
    let env = std::env::var(CPUS_ENV).ok().filter(|v| !v.trim().is_empty());
    let (key, given) = match (option.filter(|v| !v.trim().is_empty()), env.as_deref()) {
        (Some(v), _) => ("option hixl.cpus", Some(v)),
        (None, Some(v)) => (CPUS_ENV, Some(v)),
        (None, None) => ("", None),
    };
    let cpus: Cpus = match given {
        None => allowed.into(),
        Some(v) => {
            let Some(list) = parse_list(v) else {
                return Err(Error::param(format!("{key}={v:?} is not a CPU list (such as \"0-3,6\")")));
            };
            let outside: Vec<usize> = list.iter().copied().filter(|c| !allowed.contains(c)).collect();
            if !outside.is_empty() {
                return Err(Error::param(format!(
                    "{key}={v:?} names CPUs this process may not run on ({}); it may run on {}",
                    format_list(&outside),
                    format_list(&allowed)
                )));
            }
            list.into()
        }
    };
    *LAST.write().unwrap() = Some(cpus.clone());
    Ok(cpus)
}

/// The CPU set of the engine initialized last in this process (None before any): where the
/// host's threads that work for hixl (its Python layers') should run.
pub fn last() -> Option<Cpus> {
    LAST.read().unwrap().clone()
}

/// The set a thread started from the calling thread takes: the calling hixl thread's, else the
/// last initialized engine's (None before any: the new thread keeps the inherited mask).
pub(crate) fn inherited() -> Option<Cpus> {
    MINE.with(|m| m.borrow().clone()).or_else(last)
}

/// Starts a named hixl thread pinned to the `inherited` set.
pub fn spawn<F, T>(name: String, f: F) -> std::io::Result<JoinHandle<T>>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    spawn_on(name, inherited(), f)
}

/// Starts a named hixl thread that pins itself to `cpus` (None: the inherited mask) before it
/// runs `f`.
pub(crate) fn spawn_on<F, T>(name: String, cpus: Option<Cpus>, f: F) -> std::io::Result<JoinHandle<T>>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    std::thread::Builder::new().name(name).spawn(move || {
        if let Some(c) = cpus {
            // A set checked at `initialize` only fails where the process's own set shrank
            // since (a cgroup change): the thread then runs where the kernel lets it.
            if let Err(e) = affinity::set_current(&c) {
                tracing::warn!("cannot pin a hixl thread to CPUs {}: {e}", format_list(&c));
            }
            MINE.with(|m| *m.borrow_mut() = Some(c));
        }
        f()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_parse_and_print_back() {
        assert_eq!(parse_list("0-3,6"), Some(vec![0, 1, 2, 3, 6]));
        assert_eq!(parse_list(" 1 , 0 ,1"), Some(vec![0, 1]));
        for bad in ["", "a", "3-1", "1,,2", "-1", "0-", "99999"] {
            assert_eq!(parse_list(bad), None, "{bad:?}");
        }
        assert_eq!(format_list(&[0, 1, 2, 3, 6, 8, 9]), "0-3,6,8-9");
    }

    #[test]
    fn a_thread_started_here_takes_the_given_set_not_the_callers() {
        let allowed = affinity::current().unwrap();
        let first = allowed[0];
        let got = spawn_on("hixl-test".into(), Some(vec![first].into()), || {
            let nested = spawn("hixl-test2".into(), affinity::current).unwrap().join().unwrap();
            (affinity::current().unwrap(), nested.unwrap())
        })
        .unwrap()
        .join()
        .unwrap();
        assert_eq!(got, (vec![first], vec![first]));
    }
}
