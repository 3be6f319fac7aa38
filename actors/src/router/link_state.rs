//! What a router's link to one worker decides between its I/O (`links::maintain` dials,
//! reads and sleeps): when to dial again and after how long, what to say about it, and when
//! to stop. Driven by the outcome of each attempt, so its rules are tested without a network
//! or a clock.
//!
//! The rules: a failed dial waits a backoff step (doubling from 100 ms to 2 s, jittered) and
//! is reported once, not at every retry, until the worker has been reached again; a
//! connection that comes up resets the backoff; a lost connection is reported every time
//! (each loss takes the worker out of routing) and is redialled after a step; a link whose
//! worker has left the membership stops, whatever the attempt's outcome.

use std::time::Duration;

use kvmesh_discovery::Backoff;

/// The outcome of one attempt, as the I/O side saw it.
#[derive(Debug)]
pub(crate) enum Attempt {
    /// The dial failed with this error.
    Unreachable(String),
    /// Connected, then lost for this reason (closed, or silent for too long).
    Lost(String),
}

/// What the I/O side does next.
#[derive(Debug, PartialEq)]
pub(crate) enum Next {
    /// Log `warn` (if any), wait `after`, dial again.
    Retry {
        warn: Option<String>,
        after: Duration,
    },
    /// The worker left: the link ends.
    Stop,
}

pub(crate) struct LinkState {
    backoff: Backoff,
    /// Whether a failed dial was reported since the worker was last reached.
    warned: bool,
}

impl LinkState {
    pub(crate) fn new() -> LinkState {
        LinkState::with_backoff(Backoff::new(
            Duration::from_millis(100),
            Duration::from_secs(2),
        ))
    }

    pub(crate) fn with_backoff(backoff: Backoff) -> LinkState {
        LinkState {
            backoff,
            warned: false,
        }
    }

    /// The dial succeeded: the next failure starts from the first step and is reported.
    pub(crate) fn connected(&mut self) {
        self.backoff.reset();
        self.warned = false;
    }

    /// After an attempt ended; `gone`: the worker is no longer a member.
    pub(crate) fn after(&mut self, attempt: Attempt, gone: bool, worker: &str) -> Next {
        if gone {
            return Next::Stop;
        }
        let warn = match attempt {
            Attempt::Lost(reason) => Some(format!(
                "lost worker {worker}: {reason}; out of routing until it reconnects"
            )),
            Attempt::Unreachable(e) if !self.warned => {
                self.warned = true;
                Some(format!("cannot reach worker {worker}: {e}"))
            }
            Attempt::Unreachable(_) => None,
        };
        Next::Retry {
            warn,
            after: self.backoff.next_delay(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state() -> LinkState {
        LinkState::with_backoff(
            Backoff::seeded(Duration::from_millis(100), Duration::from_secs(2), 7).with_jitter(0.0),
        )
    }

    fn retry(n: Next) -> (Option<String>, Duration) {
        match n {
            Next::Retry { warn, after } => (warn, after),
            Next::Stop => panic!("stopped"),
        }
    }

    #[test]
    fn an_unreachable_worker_is_reported_once_and_retried_ever_more_slowly() {
        let mut s = state();
        let mut waits = Vec::new();
        let mut warnings = 0;
        for _ in 0..8 {
            let (warn, after) = retry(s.after(Attempt::Unreachable("refused".into()), false, "w1"));
            warnings += warn.is_some() as usize;
            waits.push(after.as_millis());
        }
        assert_eq!(warnings, 1);
        assert_eq!(waits, [100, 200, 400, 800, 1600, 2000, 2000, 2000]);
    }

    #[test]
    fn reaching_the_worker_resets_the_backoff_and_rearms_the_warning() {
        let mut s = state();
        for _ in 0..4 {
            s.after(Attempt::Unreachable("refused".into()), false, "w1");
        }
        s.connected();
        let (warn, after) = retry(s.after(Attempt::Lost("closed by peer".into()), false, "w1"));
        assert_eq!(after, Duration::from_millis(100));
        let warn = warn.expect("a loss is always reported");
        assert!(warn.contains("lost worker w1: closed by peer"), "{warn}");
        // Unreachable again after it was reached: said once more.
        let (warn, after) = retry(s.after(Attempt::Unreachable("timed out".into()), false, "w1"));
        assert_eq!(warn.as_deref(), Some("cannot reach worker w1: timed out"));
        assert_eq!(after, Duration::from_millis(200));
    }

    #[test]
    fn every_loss_is_reported() {
        let mut s = state();
        for _ in 0..3 {
            s.connected();
            let (warn, _) = retry(s.after(Attempt::Lost("nothing heard".into()), false, "w2"));
            assert!(warn.is_some());
        }
    }

    #[test]
    fn a_worker_that_left_stops_the_link_whatever_happened() {
        let mut s = state();
        assert_eq!(
            s.after(Attempt::Lost("closed".into()), true, "w3"),
            Next::Stop
        );
        assert_eq!(
            s.after(Attempt::Unreachable("refused".into()), true, "w3"),
            Next::Stop
        );
    }

    #[test]
    fn jittered_delays_stay_within_their_step() {
        let mut s = LinkState::with_backoff(Backoff::seeded(
            Duration::from_millis(100),
            Duration::from_secs(2),
            11,
        ));
        let mut step = 100u128;
        for _ in 0..10 {
            let (_, after) = retry(s.after(Attempt::Unreachable("x".into()), false, "w"));
            let ms = after.as_millis();
            assert!(
                ms <= step && ms * 4 >= step * 3,
                "{ms} ms for a step of {step}"
            );
            step = (step * 2).min(2000);
        }
    }
}
