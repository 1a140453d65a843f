//! The execution plane and the Coordinator: workers claim step jobs, the engine executes the
//! one instruction the Brain chose, and the Coordinator commits the result and publishes its
//! events — in that order, so nothing is observed that is not durable.
//!
//! This crate depends on the storage *port* only, never on an adapter.

mod activity;
pub mod cadence;
mod coordinator;
mod delegation;
mod engine;
mod gates;
mod input;
mod memory;
mod models;
pub mod scheduler;
mod worker;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

pub use activity::{LiveActivity, Observed};
pub use coordinator::{Coordinator, ForkedRun, Multitask, StartedRun};
pub use engine::{DEFAULT_CANCEL_GRACE, Engine, Executed, StepFailure};
pub use gates::{PermitLimits, StepPermits};
pub use models::Models;
pub use worker::{WorkerPool, owner_is_dead_local_process, process_owner};

use ratchet_core::Millis;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Store(#[from] ratchet_store::Error),
    #[error(transparent)]
    Model(#[from] ratchet_llm::Error),
    #[error("{0}")]
    Invalid(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Tunables of the worker pool.
#[derive(Debug, Clone)]
pub struct PoolConfig {
    /// Concurrent steps this process runs.
    pub workers: usize,
    /// How long a claim is valid without a heartbeat.
    pub lease: Duration,
    /// How often a running step renews its lease.
    pub heartbeat: Duration,
    /// How often an idle worker looks for jobs that no wake-up announced (retries coming due,
    /// expired leases, jobs written by other processes).
    pub poll: Duration,
    /// Steps of one run a worker executes back to back before letting other runs in.
    pub max_streak: u32,
    /// First delay before a failed model call is tried again; doubles per attempt.
    pub retry_backoff: Duration,
    /// Claim only this run's jobs: a driver for one run (`ratchet run`) leaves every other
    /// run in the database alone.
    pub only_run: Option<ratchet_core::RunId>,
    /// How long a tool call may go on after its step was cut off (a cancel, the run's
    /// deadline) before its task is aborted and its outcome is unknown; a shutdown also lets
    /// steps in flight run this long before cutting them off.
    pub cancel_grace: Duration,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            workers: 16,
            lease: Duration::from_secs(15),
            heartbeat: Duration::from_secs(5),
            poll: Duration::from_millis(250),
            max_streak: 64,
            retry_backoff: Duration::from_millis(200),
            only_run: None,
            cancel_grace: engine::DEFAULT_CANCEL_GRACE,
        }
    }
}

/// What time it is for the runtime: what it stamps on what it writes, and what leases,
/// deadlines and backoffs are measured against. The Coordinator holds one, and the engine
/// and the workers read it there, so a test can run the whole runtime on tokio's clock.
#[derive(Debug, Clone, Copy)]
pub enum Clock {
    /// The wall clock, in milliseconds since the Unix epoch.
    System,
    /// Tokio's clock, counted from `epoch` at `start`: with tokio's time paused, time passes
    /// only as a test advances it (or, with nothing else to do, as tokio skips to the next
    /// timer), so what waits for a lease to expire or a deadline to pass takes no real time.
    Tokio {
        epoch: Millis,
        start: tokio::time::Instant,
    },
}

impl Clock {
    /// Tokio's clock, reading `epoch` now. Call inside a tokio runtime.
    pub fn tokio_from(epoch: Millis) -> Clock {
        Clock::Tokio {
            epoch,
            start: tokio::time::Instant::now(),
        }
    }

    /// Milliseconds since the epoch.
    pub fn now(&self) -> Millis {
        match self {
            Clock::System => SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as Millis),
            Clock::Tokio { epoch, start } => epoch + start.elapsed().as_millis() as Millis,
        }
    }
}
