//! The one cap on waits: every timeout a caller passes is honoured up to [`MAX_WAIT`].

use std::time::Duration;

/// The longest wait any call honours: a longer timeout (`Duration::MAX` included) means this.
pub const MAX_WAIT: Duration = Duration::from_secs(365 * 86_400);

/// `t`, at most [`MAX_WAIT`] (so that `Instant::now() + t` cannot overflow).
pub(crate) fn capped(t: Duration) -> Duration {
    t.min(MAX_WAIT)
}
