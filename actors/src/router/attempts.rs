//! One request's way through the workers: its attempts, the rounds over every worker with
//! backoff between them, and its migrations.
//!
//! A request that has produced nothing when its worker fails or refuses it is retried on
//! another worker; when every worker was tried, it waits for one to join or restart (with
//! backoff, up to a patience), except when every one was full: then after a few short rounds
//! the client is told to come back (429) rather than kept waiting. A request already
//! streaming **migrates**: the prompt plus the tokens already streamed (and the seeded
//! generator's draws spent on them) go to another worker, which continues the sequence; the
//! client's stream goes on with no repeated or missing token. A request migrates at most
//! `migration_limit` times, then ends with an error event naming the worker.
//!
//! [`Attempts`] is that state and its decisions, with no I/O; [`drive`] runs it against the
//! workers a [`Route`] reaches, so tests drive it with fake workers.

use std::collections::HashSet;
use std::future::Future;
use std::sync::atomic::Ordering;
use std::time::Duration;

use kvmesh_discovery::Backoff;
use kvmesh_gateway::dispatch::{Event, Unavailable};
use kvmesh_gpu::engine::{FinishReason, SeqEvent};
use kvmesh_gpu::sampler::Sampled;
use kvmesh_transport::wire::GenerateRequest;
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::stats::RouterStats;

/// How long a request that has produced nothing waits for some worker to take it, after
/// every worker it tried failed or refused it.
pub const UNSTARTED_PATIENCE: Duration = Duration::from_secs(10);

/// How many more rounds over the workers a request makes, backing off between them, when
/// every worker's queue was full, before it is refused with 429.
pub const FULL_ROUNDS: u32 = 2;

/// The first wait between rounds; it doubles each round up to [`MAX_BACKOFF`]. Unjittered:
/// a round's wait is part of what a client sees (three full rounds are 300 ms before a
/// 429), and requests already arrive spread out; the reconnecting loops jitter.
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(1);

/// How one attempt at a worker ended.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    Done,
    ClientGone,
    /// Nothing reached the client: another worker may take it.
    NotStarted(String),
    /// The worker's queue is full: another may take it, and when none can, the client is
    /// told to come back (429) rather than kept waiting.
    Full(String),
    /// The worker was lost after `tokens` tokens of this attempt reached the client.
    Broken {
        tokens: usize,
        reason: String,
    },
}

impl Outcome {
    /// Its name in the attempt's span, and the error it records, if any.
    pub fn describe(&self) -> (&'static str, Option<&str>) {
        match self {
            Outcome::Done => ("done", None),
            Outcome::ClientGone => ("client_gone", None),
            Outcome::NotStarted(r) => ("not_started", Some(r)),
            Outcome::Full(r) => ("queue_full", Some(r)),
            Outcome::Broken { reason, .. } => ("broken", Some(reason)),
        }
    }
}

/// What a request has streamed to its client so far, across workers.
#[derive(Debug, Default)]
pub struct Streamed {
    pub tokens: Vec<u32>,
    /// The first worker's cached prompt tokens: what the client's usage reports, however
    /// many workers the sequence passed through.
    pub cached_tokens: Option<usize>,
    /// The cached tokens the latest attempt's worker reported with its first token.
    pub attempt_cached: usize,
}

impl Streamed {
    /// A token from the attempt's worker (`nth` of this attempt, from 1), as the client is
    /// sent it.
    pub fn push(
        &mut self,
        nth: usize,
        sampled: Sampled,
        finish: Option<FinishReason>,
        cached_tokens: usize,
    ) -> Event {
        if nth == 1 {
            self.attempt_cached = cached_tokens;
        }
        self.tokens.push(sampled.token);
        let cached_tokens = *self.cached_tokens.get_or_insert(cached_tokens);
        Event::Engine(SeqEvent::Token {
            sampled,
            finish,
            cached_tokens,
        })
    }
}

/// What an attempt's span says of its place in the request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttemptInfo {
    /// From 1.
    pub n: u32,
    /// Migrations before this attempt.
    pub migration: u32,
    /// Tokens already streamed, which this attempt continues after.
    pub resumed_after: usize,
}

/// After every worker was tried: wait this long and go round again, or give up.
#[derive(Debug, PartialEq)]
pub enum RoundOver {
    Wait(Duration),
    Refuse { why: Unavailable, message: String },
}

/// After an attempt: done, try another worker, or give up with this message.
#[derive(Debug, PartialEq)]
pub enum Next {
    Finished,
    /// Retry elsewhere (the request had not started there).
    Retry,
    /// Continue elsewhere after the tokens already streamed.
    Migrate,
    /// Lost mid-stream past the migration limit.
    Lost(String),
}

/// One request's attempts, rounds and migrations, with no I/O.
pub struct Attempts {
    base: GenerateRequest,
    /// Greedy requests draw no random numbers: a continuation skips none.
    greedy: bool,
    migration_limit: u32,
    pub sent: Streamed,
    tried: HashSet<String>,
    last_error: String,
    give_up: Instant,
    backoff: Backoff,
    /// This round: whether some worker refused as full, and whether every one did.
    full_seen: bool,
    all_full: bool,
    full_rounds: u32,
    migrations: u32,
    attempts: u32,
}

impl Attempts {
    pub fn new(base: GenerateRequest, migration_limit: u32, now: Instant) -> Attempts {
        Attempts {
            greedy: base.temperature <= 1e-5 || base.top_k == 1,
            base,
            migration_limit,
            sent: Streamed::default(),
            tried: HashSet::new(),
            last_error: String::from("no worker was connected"),
            give_up: now + UNSTARTED_PATIENCE,
            backoff: Backoff::new(FIRST_BACKOFF, MAX_BACKOFF).with_jitter(0.0),
            full_seen: false,
            all_full: true,
            full_rounds: 0,
            migrations: 0,
            attempts: 0,
        }
    }

    pub fn request_id(&self) -> u64 {
        self.base.request_id
    }

    /// Workers tried since the last round began.
    pub fn tried(&self) -> &HashSet<String> {
        &self.tried
    }

    pub fn migrations(&self) -> u32 {
        self.migrations
    }

    /// What the next attempt sends: after tokens were streamed, the sequence so far is the
    /// prompt, the worker generates the rest, and a seeded generator skips the draws spent.
    pub fn request(&self) -> GenerateRequest {
        let mut r = self.base.clone();
        let sent = &self.sent.tokens;
        if !sent.is_empty() {
            r.prompt.extend_from_slice(sent);
            r.max_tokens = r.max_tokens.saturating_sub(sent.len() as u32);
            if !self.greedy {
                r.resume_draws += sent.len() as u64;
            }
            // The next worker's matcher reads the streamed tokens before it continues.
            if let Some(g) = &mut r.guide {
                g.replay += sent.len() as u32;
            }
        }
        r
    }

    /// No worker left to try this round. Nothing more has reached the client since, so the
    /// request may wait: for a worker restarting or joining, with backoff, up to the
    /// patience; when every one was full, only a few short rounds, then the client is told to
    /// come back later (429), as one node would: waiting on would only pile requests onto
    /// full queues.
    pub fn round_over(&mut self, now: Instant, client_gone: bool) -> RoundOver {
        let round_full = self.full_seen && self.all_full;
        self.full_seen = false;
        self.all_full = true;
        if round_full {
            self.full_rounds += 1;
        }
        let wait = self.backoff.next_delay();
        let patient = if round_full {
            self.full_rounds <= FULL_ROUNDS
        } else {
            now + wait < self.give_up
        };
        if patient && !client_gone {
            self.tried.clear();
            return RoundOver::Wait(wait);
        }
        let last = &self.last_error;
        let (why, message) = if round_full {
            (
                Unavailable::QueueFull,
                format!(
                    "every worker's queue is full (tried {} times): {last}; retry later",
                    self.full_rounds
                ),
            )
        } else if self.migrations > 0 {
            (
                Unavailable::WorkerLost,
                format!("the request's worker was lost and no other could take it: {last}"),
            )
        } else {
            (
                Unavailable::NoWorker,
                format!(
                    "no worker could take the request within {} s: {last}",
                    UNSTARTED_PATIENCE.as_secs()
                ),
            )
        };
        RoundOver::Refuse { why, message }
    }

    /// An attempt on `worker` begins.
    pub fn begin(&mut self, worker: &str) -> AttemptInfo {
        self.attempts += 1;
        self.tried.insert(worker.to_string());
        AttemptInfo {
            n: self.attempts,
            migration: self.migrations,
            resumed_after: self.sent.tokens.len(),
        }
    }

    /// The attempt on `worker` ended with `outcome`.
    pub fn end(&mut self, worker: &str, outcome: &Outcome, now: Instant) -> Next {
        match outcome {
            Outcome::Done | Outcome::ClientGone => Next::Finished,
            Outcome::NotStarted(reason) => {
                self.last_error = format!("{worker}: {reason}");
                self.all_full = false;
                Next::Retry
            }
            Outcome::Full(reason) => {
                self.last_error = format!("{worker}: {reason}");
                self.full_seen = true;
                Next::Retry
            }
            Outcome::Broken { reason, .. } => {
                if self.migrations < self.migration_limit {
                    self.migrations += 1;
                    self.last_error = format!("{worker}: {reason}");
                    self.give_up = now + UNSTARTED_PATIENCE;
                    self.backoff.reset();
                    return Next::Migrate;
                }
                Next::Lost(format!(
                    "worker {worker} was lost after {} generated tokens: {reason} (the \
                     request had moved {} times, the limit)",
                    self.sent.tokens.len(),
                    self.migrations
                ))
            }
        }
    }
}

/// The workers a request can be sent to, as [`drive`] reaches them.
pub(crate) trait Route: Sync {
    type Pick: Send;

    /// A worker for `req` among those not in `tried` (`None`: no worker left this round);
    /// `describe` asks for the candidates as text (a traced request).
    fn choose(
        &self,
        req: &GenerateRequest,
        tried: &HashSet<String>,
        describe: bool,
    ) -> Option<Self::Pick>;

    fn worker<'p>(&self, pick: &'p Self::Pick) -> &'p str;

    /// Sends `req` to the picked worker and streams its tokens to `tx` (recording them in
    /// `sent`) until it ends.
    fn attempt(
        &self,
        pick: Self::Pick,
        req: GenerateRequest,
        info: AttemptInfo,
        sent: &mut Streamed,
        tx: &mpsc::UnboundedSender<Event>,
    ) -> impl Future<Output = Outcome> + Send;
}

/// Runs one request's attempts until it finishes, its client leaves, or it is refused; what
/// it decides is counted in `stats` and recorded on the current span (the request's route).
pub async fn drive<R: Route>(
    route: &R,
    mut attempts: Attempts,
    stats: &RouterStats,
    tx: &mpsc::UnboundedSender<Event>,
) {
    let span = tracing::Span::current();
    let traced = kvmesh_telemetry::is_sampled(&span);
    let id = attempts.request_id();
    loop {
        let req = attempts.request();
        let Some(pick) = route.choose(&req, attempts.tried(), traced) else {
            match attempts.round_over(Instant::now(), tx.is_closed()) {
                RoundOver::Wait(wait) => {
                    tokio::time::sleep(wait).await;
                    continue;
                }
                RoundOver::Refuse { why, message } => {
                    let counter = match why {
                        Unavailable::QueueFull => &stats.full,
                        _ => &stats.no_worker,
                    };
                    counter.fetch_add(1, Ordering::Relaxed);
                    span.record("otel.status_code", "ERROR");
                    span.record("otel.status_description", message.as_str());
                    let _ = tx.send(Event::Unavailable { message, why });
                    return;
                }
            }
        };
        let worker = route.worker(&pick).to_string();
        let info = attempts.begin(&worker);
        span.record("attempts", info.n);
        stats.routed.fetch_add(1, Ordering::Relaxed);
        let outcome = route.attempt(pick, req, info, &mut attempts.sent, tx).await;
        match attempts.end(&worker, &outcome, Instant::now()) {
            Next::Finished => return,
            Next::Retry => {
                stats.retries.fetch_add(1, Ordering::Relaxed);
                match &outcome {
                    Outcome::Full(reason) => tracing::debug!(
                        "request {id}: worker {worker} is full ({reason}); trying another"
                    ),
                    _ => tracing::info!(
                        "request {id}: worker {worker} did not start it ({}); retrying elsewhere",
                        outcome.describe().1.unwrap_or_default()
                    ),
                }
            }
            Next::Migrate => {
                stats.migrations.fetch_add(1, Ordering::Relaxed);
                let migrations = attempts.migrations();
                span.record("migrations", migrations);
                if let Outcome::Broken { tokens, reason } = &outcome {
                    tracing::warn!(
                        "request {id}: worker {worker} was lost after {tokens} tokens ({reason}); \
                         continuing after token {} elsewhere (migration {migrations} of at most {})",
                        attempts.sent.tokens.len(),
                        attempts.migration_limit
                    );
                }
            }
            Next::Lost(message) => {
                stats.failed_midstream.fetch_add(1, Ordering::Relaxed);
                span.record("otel.status_code", "ERROR");
                span.record("otel.status_description", message.as_str());
                let _ = tx.send(Event::Unavailable {
                    message,
                    why: Unavailable::WorkerLost,
                });
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{HashMap, VecDeque};
    use std::sync::Mutex;

    use super::*;

    /// What a fake worker does with a request sent to it.
    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Act {
        /// Generates the rest of the request. Each token is the length of the sequence
        /// before it, so a continuation elsewhere must go on with exactly the tokens one
        /// worker would have produced.
        Complete,
        /// Streams this many tokens, then its connection breaks.
        BreakAfter(usize),
        /// Not started: the worker's role is restarting.
        Refuse,
        /// Not started: the node is shutting down (what a draining worker answers).
        Draining,
        /// Its queue is full.
        Full,
    }

    /// Workers in a fixed order, each following its script (then completing); a worker that
    /// breaks a stream is gone from then on.
    struct Fake {
        workers: Vec<&'static str>,
        script: Mutex<HashMap<&'static str, VecDeque<Act>>>,
        /// Every attempt: the worker and what it was sent.
        log: Mutex<Vec<(String, GenerateRequest, AttemptInfo)>>,
        down: Mutex<HashSet<String>>,
    }

    impl Fake {
        fn new(workers: &[&'static str], script: &[(&'static str, &[Act])]) -> Fake {
            Fake {
                workers: workers.to_vec(),
                script: Mutex::new(
                    script
                        .iter()
                        .map(|(w, acts)| (*w, acts.iter().copied().collect()))
                        .collect(),
                ),
                log: Mutex::new(Vec::new()),
                down: Mutex::new(HashSet::new()),
            }
        }

        /// Every worker always answers with `act`.
        fn always(workers: &[&'static str], act: Act) -> Fake {
            let f = Fake::new(workers, &[]);
            for w in workers {
                f.script.lock().unwrap().insert(w, vec![act; 1000].into());
            }
            f
        }

        fn log(&self) -> Vec<(String, GenerateRequest, AttemptInfo)> {
            self.log.lock().unwrap().clone()
        }
    }

    impl Route for Fake {
        type Pick = &'static str;

        fn choose(
            &self,
            _req: &GenerateRequest,
            tried: &HashSet<String>,
            _describe: bool,
        ) -> Option<&'static str> {
            let down = self.down.lock().unwrap();
            self.workers
                .iter()
                .copied()
                .find(|w| !tried.contains(*w) && !down.contains(*w))
        }

        fn worker<'p>(&self, pick: &'p &'static str) -> &'p str {
            pick
        }

        async fn attempt(
            &self,
            pick: &'static str,
            req: GenerateRequest,
            info: AttemptInfo,
            sent: &mut Streamed,
            tx: &mpsc::UnboundedSender<Event>,
        ) -> Outcome {
            let act = self
                .script
                .lock()
                .unwrap()
                .get_mut(pick)
                .and_then(|q| q.pop_front())
                .unwrap_or(Act::Complete);
            self.log
                .lock()
                .unwrap()
                .push((pick.to_string(), req.clone(), info));
            let limit = match act {
                Act::Refuse => return Outcome::NotStarted("its role is restarting".into()),
                Act::Draining => return Outcome::NotStarted("this node is shutting down".into()),
                Act::Full => return Outcome::Full("the queue is full".into()),
                Act::Complete => req.max_tokens as usize,
                Act::BreakAfter(k) => k.min(req.max_tokens as usize),
            };
            for i in 0..limit {
                let last = act == Act::Complete && i + 1 == limit;
                let token = Sampled {
                    token: (req.prompt.len() + i) as u32,
                    logprob: 0.0,
                    top: vec![],
                };
                let finish = last.then_some(FinishReason::Length);
                if tx.send(sent.push(i + 1, token, finish, 7)).is_err() {
                    return Outcome::ClientGone;
                }
            }
            if act == Act::Complete {
                return Outcome::Done;
            }
            self.down.lock().unwrap().insert(pick.to_string());
            Outcome::Broken {
                tokens: limit,
                reason: "connection lost".into(),
            }
        }
    }

    fn request(max_tokens: u32, temperature: f32, seed: Option<u64>) -> GenerateRequest {
        GenerateRequest {
            request_id: 1,
            prompt: vec![100, 101, 102, 103],
            temperature,
            top_k: 0,
            top_p: 1.0,
            seed,
            max_tokens,
            stop_token_ids: vec![],
            ignore_eos: false,
            logprobs: None,
            resume_draws: 2,
            traceparent: None,
            prefill: None,
            logit_bias: vec![],
            guide: Some(kvmesh_transport::wire::WireGuide {
                grammar: "{}".into(),
                replay: 1,
            }),
        }
    }

    /// What the client received: its tokens, whether the last one finished the stream,
    /// the cached tokens its usage reports, and a refusal if it got one.
    #[derive(Debug, Default)]
    struct Received {
        tokens: Vec<u32>,
        finished: bool,
        cached: Option<usize>,
        refused: Option<(Unavailable, String)>,
    }

    async fn run(fake: &Fake, req: GenerateRequest, limit: u32) -> (Received, RouterStats) {
        let stats = RouterStats::default();
        let (tx, mut rx) = mpsc::unbounded_channel();
        drive(fake, Attempts::new(req, limit, Instant::now()), &stats, &tx).await;
        drop(tx);
        let mut got = Received::default();
        while let Some(ev) = rx.recv().await {
            match ev {
                Event::Engine(SeqEvent::Token {
                    sampled,
                    finish,
                    cached_tokens,
                }) => {
                    got.tokens.push(sampled.token);
                    got.finished = finish.is_some();
                    got.cached = Some(cached_tokens);
                }
                Event::Engine(SeqEvent::Failed(m)) => panic!("failed: {m}"),
                Event::Unavailable { message, why } => got.refused = Some((why, message)),
            }
        }
        (got, stats)
    }

    fn count(a: &std::sync::atomic::AtomicU64) -> u64 {
        a.load(Ordering::Relaxed)
    }

    /// The tokens one worker alone would have streamed for `request(max, ..)`.
    fn whole(max: u32) -> Vec<u32> {
        (4..4 + max).collect()
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_refused_before_its_first_token_goes_to_the_next_worker() {
        let fake = Fake::new(
            &["a", "b", "c"],
            &[("a", &[Act::Refuse]), ("b", &[Act::Draining])],
        );
        let (got, stats) = run(&fake, request(5, 0.8, Some(9)), 3).await;
        assert_eq!(got.tokens, whole(5));
        assert!(got.finished && got.refused.is_none());
        let log = fake.log();
        let workers: Vec<_> = log.iter().map(|(w, ..)| w.as_str()).collect();
        assert_eq!(workers, ["a", "b", "c"]);
        // Nothing was streamed: every worker is sent the request as it came.
        assert!(log.iter().all(|(_, r, _)| *r == request(5, 0.8, Some(9))));
        assert_eq!(log[2].2.n, 3);
        assert_eq!((count(&stats.retries), count(&stats.routed)), (2, 3));
        assert_eq!(count(&stats.migrations), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_broken_stream_continues_elsewhere_after_the_tokens_already_streamed() {
        let fake = Fake::new(&["a", "b"], &[("a", &[Act::BreakAfter(3)])]);
        let (got, stats) = run(&fake, request(8, 0.8, Some(9)), 3).await;
        // The client sees one stream: no token repeated or missing.
        assert_eq!(got.tokens, whole(8));
        assert!(got.finished);
        // Usage reports the first worker's cached tokens.
        assert_eq!(got.cached, Some(7));
        let log = fake.log();
        let (worker, resumed, info) = &log[1];
        assert_eq!(worker, "b");
        // The sequence so far is the new prompt; the rest of max_tokens is generated; the
        // seeded generator skips the three draws the first worker spent.
        assert_eq!(
            resumed.prompt,
            [&[100, 101, 102, 103][..], &whole(3)].concat()
        );
        assert_eq!(resumed.max_tokens, 5);
        assert_eq!(resumed.resume_draws, 2 + 3);
        // Its grammar replays them too.
        assert_eq!(resumed.guide.as_ref().map(|g| g.replay), Some(1 + 3));
        assert_eq!(
            *info,
            AttemptInfo {
                n: 2,
                migration: 1,
                resumed_after: 3
            }
        );
        assert_eq!(count(&stats.migrations), 1);
        assert_eq!(count(&stats.retries), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_greedy_continuation_skips_no_draws() {
        let fake = Fake::new(&["a", "b"], &[("a", &[Act::BreakAfter(2)])]);
        let (got, _) = run(&fake, request(6, 0.0, None), 3).await;
        assert_eq!(got.tokens, whole(6));
        let resumed = &fake.log()[1].1;
        assert_eq!((resumed.max_tokens, resumed.resume_draws), (4, 2));
    }

    #[tokio::test(start_paused = true)]
    async fn when_every_worker_is_full_the_client_is_told_429_after_a_few_rounds() {
        let fake = Fake::always(&["a", "b"], Act::Full);
        let started = Instant::now();
        let (got, stats) = run(&fake, request(4, 0.8, None), 3).await;
        let (why, message) = got.refused.expect("refused");
        assert_eq!(why, Unavailable::QueueFull);
        assert!(
            message.contains("every worker's queue is full (tried 3 times)"),
            "{message}"
        );
        assert!(got.tokens.is_empty());
        // Three rounds over both workers, 100 and 200 ms apart.
        assert_eq!(fake.log().len(), 2 * (FULL_ROUNDS as usize + 1));
        assert_eq!(started.elapsed(), Duration::from_millis(300));
        assert_eq!((count(&stats.full), count(&stats.no_worker)), (1, 0));
    }

    #[tokio::test(start_paused = true)]
    async fn when_no_worker_takes_it_within_the_patience_the_client_is_told_503() {
        let fake = Fake::always(&["a", "b"], Act::Draining);
        let started = Instant::now();
        let (got, stats) = run(&fake, request(4, 0.8, None), 3).await;
        let (why, message) = got.refused.expect("refused");
        assert_eq!(why, Unavailable::NoWorker);
        assert!(
            message.contains("no worker could take the request within 10 s")
                && message.contains("this node is shutting down"),
            "{message}"
        );
        assert!(started.elapsed() <= UNSTARTED_PATIENCE);
        assert!(started.elapsed() >= UNSTARTED_PATIENCE - MAX_BACKOFF);
        assert_eq!((count(&stats.no_worker), count(&stats.full)), (1, 0));
    }

    #[tokio::test(start_paused = true)]
    async fn a_moved_stream_that_no_worker_can_continue_ends_with_502() {
        let fake = Fake::new(&["a", "b"], &[("a", &[Act::BreakAfter(2)])]);
        fake.script
            .lock()
            .unwrap()
            .insert("b", vec![Act::Refuse; 1000].into());
        let (got, stats) = run(&fake, request(6, 0.8, None), 3).await;
        // The client has what the lost worker streamed, then the error.
        assert_eq!(got.tokens, whole(2));
        assert!(!got.finished);
        let (why, message) = got.refused.expect("refused");
        assert_eq!(why, Unavailable::WorkerLost);
        assert!(
            message.contains("the request's worker was lost and no other could take it"),
            "{message}"
        );
        assert_eq!(count(&stats.migrations), 1);
        assert_eq!(count(&stats.no_worker), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn past_the_migration_limit_the_stream_ends_with_502() {
        let fake = Fake::new(
            &["a", "b", "c"],
            &[("a", &[Act::BreakAfter(2)]), ("b", &[Act::BreakAfter(2)])],
        );
        let (got, stats) = run(&fake, request(8, 0.8, None), 1).await;
        assert_eq!(got.tokens, whole(4));
        let (why, message) = got.refused.expect("refused");
        assert_eq!(why, Unavailable::WorkerLost);
        assert!(
            message.contains("worker b was lost after 4 generated tokens")
                && message.contains("moved 1 times, the limit"),
            "{message}"
        );
        assert_eq!(fake.log().len(), 2, "c is never tried");
        assert_eq!(
            (count(&stats.migrations), count(&stats.failed_midstream)),
            (1, 1)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_client_that_left_is_not_waited_for() {
        let fake = Fake::always(&["a"], Act::Refuse);
        let stats = RouterStats::default();
        let (tx, rx) = mpsc::unbounded_channel();
        drop(rx);
        let started = Instant::now();
        drive(
            &fake,
            Attempts::new(request(4, 0.8, None), 3, started),
            &stats,
            &tx,
        )
        .await;
        assert_eq!(started.elapsed(), Duration::ZERO);
        assert_eq!(fake.log().len(), 1);
    }
}
