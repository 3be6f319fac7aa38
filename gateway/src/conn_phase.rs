//! What an HTTP connection is doing, for its head and idle timeouts, as a value driven by
//! events and the time they happen at: no clock read, no task, so every rule is a unit test
//! on made-up instants. `http::Clock` holds one behind a lock and sleeps until its deadline.
//!
//! The rules: a connection starts waiting for a request head, which must be complete within
//! the header timeout; while requests are in flight nothing times out (their bodies and
//! sends have their own timeouts); when the last response is sent the connection is idle,
//! closed after the idle timeout unless bytes of a next request arrive, which start that
//! head's time.

use std::time::Duration;

// tokio's instant: the same as std's, but paused with the runtime's clock in tests that
// pause it.
use tokio::time::Instant;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Waiting for a request head to be complete, until the deadline.
    Head(Option<Instant>),
    /// Nothing in flight and no byte of the next request yet.
    Idle(Option<Instant>),
    /// This many requests in flight (their heads were read; their responses not yet sent).
    Busy(usize),
}

/// Which timeout closed the connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Expired {
    Head,
    Idle,
}

#[derive(Clone, Debug)]
pub(crate) struct ConnPhase {
    header: Option<Duration>,
    idle: Option<Duration>,
    phase: Phase,
}

impl ConnPhase {
    /// A connection accepted at `now`: its first head's time runs.
    pub(crate) fn new(header: Option<Duration>, idle: Option<Duration>, now: Instant) -> ConnPhase {
        ConnPhase {
            header,
            idle,
            phase: Phase::Head(header.map(|d| now + d)),
        }
    }

    #[cfg(test)]
    pub(crate) fn phase(&self) -> Phase {
        self.phase
    }

    pub(crate) fn is_idle(&self) -> bool {
        matches!(self.phase, Phase::Idle(_))
    }

    /// Bytes came in at `now`: after an idle pause, the next head's time starts. Whether
    /// the phase changed.
    pub(crate) fn bytes_read(&mut self, now: Instant) -> bool {
        match self.phase {
            Phase::Idle(_) => {
                self.phase = Phase::Head(self.header.map(|d| now + d));
                true
            }
            _ => false,
        }
    }

    /// A request head was read: no head or idle timeout until its response is sent.
    pub(crate) fn request_started(&mut self) {
        self.phase = match self.phase {
            Phase::Busy(n) => Phase::Busy(n + 1),
            _ => Phase::Busy(1),
        };
    }

    /// A response was sent (or its request abandoned) at `now`.
    pub(crate) fn request_done(&mut self, now: Instant) {
        self.phase = match self.phase {
            Phase::Busy(n) if n > 1 => Phase::Busy(n - 1),
            _ => Phase::Idle(self.idle.map(|d| now + d)),
        };
    }

    /// When the connection closes if nothing happens first, and why; `None` while busy or
    /// with that timeout off.
    pub(crate) fn deadline(&self) -> Option<(Instant, Expired)> {
        match self.phase {
            Phase::Head(Some(d)) => Some((d, Expired::Head)),
            Phase::Idle(Some(d)) => Some((d, Expired::Idle)),
            _ => None,
        }
    }

    /// Whether a timeout has passed at `now`.
    pub(crate) fn expired(&self, now: Instant) -> Option<Expired> {
        self.deadline()
            .and_then(|(d, why)| (now >= d).then_some(why))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    fn conn(t0: Instant) -> ConnPhase {
        ConnPhase::new(Some(10 * S), Some(75 * S), t0)
    }

    #[test]
    fn a_head_must_be_complete_within_the_header_timeout() {
        let t0 = Instant::now();
        let c = conn(t0);
        assert_eq!(c.expired(t0 + 9 * S), None);
        assert_eq!(c.expired(t0 + 10 * S), Some(Expired::Head));
        // Bytes of the head itself do not extend it: a slow sender is still timed.
        let mut c = conn(t0);
        assert!(!c.bytes_read(t0 + 5 * S));
        assert_eq!(c.expired(t0 + 10 * S), Some(Expired::Head));
    }

    #[test]
    fn nothing_times_out_while_requests_are_in_flight() {
        let t0 = Instant::now();
        let mut c = conn(t0);
        c.request_started();
        c.request_started();
        assert_eq!(c.phase(), Phase::Busy(2));
        assert_eq!(c.deadline(), None);
        assert_eq!(c.expired(t0 + 3600 * S), None);
        c.request_done(t0 + 100 * S);
        assert_eq!(c.phase(), Phase::Busy(1));
        c.request_done(t0 + 200 * S);
        assert!(c.is_idle());
        assert_eq!(c.deadline(), Some((t0 + 275 * S, Expired::Idle)));
    }

    #[test]
    fn an_idle_connection_closes_unless_a_next_request_starts() {
        let t0 = Instant::now();
        let mut c = conn(t0);
        c.request_started();
        c.request_done(t0 + S);
        assert_eq!(c.expired(t0 + 75 * S), None);
        assert_eq!(c.expired(t0 + 76 * S), Some(Expired::Idle));
        // A byte of the next request at 50 s: its head has until 60 s.
        assert!(c.bytes_read(t0 + 50 * S));
        assert_eq!(c.deadline(), Some((t0 + 60 * S, Expired::Head)));
        assert_eq!(c.expired(t0 + 76 * S), Some(Expired::Head));
        c.request_started();
        assert_eq!(c.expired(t0 + 1000 * S), None);
    }

    #[test]
    fn timeouts_switched_off_never_expire() {
        let t0 = Instant::now();
        let mut c = ConnPhase::new(None, None, t0);
        assert_eq!(c.deadline(), None);
        c.request_started();
        c.request_done(t0);
        assert!(c.is_idle());
        assert_eq!(c.expired(t0 + 1_000_000 * S), None);
    }
}
