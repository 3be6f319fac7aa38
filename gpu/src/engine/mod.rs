//! The engine: one thread that owns the backend and the block manager, and runs steps of
//! continuous batching for as long as there is work.
//!
//! Requests arrive on a channel and join the running batch at the next step. Each step gives
//! running sequences their next tokens first (a decode token, or the next chunk of a long
//! prompt), then admits waiting ones while the token budget, the sequence limit and the free
//! blocks allow. When blocks run out, the latest-arrived running sequence is preempted: its
//! blocks are freed and it goes back to the head of the queue to be recomputed (its full
//! blocks stay in the prefix cache, so the recompute is mostly a cache hit).
//!
//! Disaggregated requests (see `lease`) take two other paths through the same scheduler.
//! A decode worker's remote-prefill sequence is admitted by reserving blocks for its whole
//! prompt and lending them to a transfer; it waits, in no batch, until the KV has landed
//! (it then decodes) or the transfer gave up (it then prefills here). A prefill worker's
//! export sequence reserves its whole prompt at admission too, is never preempted, and
//! reports each layer as it is computed so the transfer overlaps the rest of the step.
//!
//! - `handle`: the way in (checks, admission count, submissions);
//! - `scheduler`: what each step runs, as a plan, with no I/O; `snapshots`: the saved
//!   recurrent states that let a model with such state resume cached prefixes;
//! - `thread`: the engine thread that carries plans out; `shared`: the driver threads and
//!   timer that carry many engines whose backend models time instead (sim replicas);
//! - `lease`: blocks lent to transfers; `kv_events`: the prefix cache's events for routers;
//! - `masks`: the thread that computes grammar masks while a step runs;
//! - `request`, `stats`: what goes in and out, and what the engine measures.

mod handle;
pub mod kv_events;
mod lease;
mod masks;
mod request;
mod scheduler;
mod shared;
#[cfg(test)]
mod shared_tests;
#[cfg(test)]
mod snapshot_tests;
mod snapshots;
mod stats;
#[cfg(test)]
mod tests;
mod thread;
#[cfg(test)]
mod transfer_tests;

pub use handle::{EngineHandle, Submission};
pub use lease::{ExportEvent, Handover, KvLease, Landed};
pub use request::{EngineConfig, EngineInfo, FinishReason, Progress, Request, SeqEvent, SeqId};
pub use shared::EnginePool;
pub use stats::{prefill_part_us, EngineStats, StepFit, StepModel};
pub use thread::spawn;
