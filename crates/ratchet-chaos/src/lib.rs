//! Chaos for Ratchet: runs a random agent workload through real `ratchet` processes while
//! killing them with SIGKILL at random instants, then checks every invariant of the design
//! (DESIGN.md §10) from the database and from what the clients received.
//!
//! The pieces: `plan` draws what each run does (parallel tool batches of safe, `never`-replay
//! and approval-gated calls, some cancels); `model` is the model those runs talk to over the
//! OpenAI wire protocol, living outside the killed processes; `fleet` starts, kills and
//! restarts `ratchet serve` and `ratchet worker`; `client` drives sessions over HTTP and SSE
//! as users would; `check` judges the result. Nothing here reaches into the runtime's
//! internals: it sees what a user and an operator see.

pub mod check;
pub mod client;
pub mod fleet;
pub mod mcp_log;
pub mod model;
pub mod plan;

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use futures::StreamExt;
use ratchet_store::Reads;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::check::Tally;
use crate::client::{Clients, SessionPlan};
use crate::fleet::{Fleet, FleetSpec};
use crate::model::ModelState;
use crate::plan::{DISPATCHER, Plan};

#[derive(Debug, Clone)]
pub enum Database {
    /// A new SQLite file in the working directory.
    Sqlite,
    /// A PostgreSQL database (empty or not: only the sessions made here are checked).
    Postgres { url: String },
}

#[derive(Debug, Clone)]
pub struct Options {
    /// The `ratchet` binary under test.
    pub ratchet: PathBuf,
    pub database: Database,
    /// How long processes are killed and restarted.
    pub duration: Duration,
    /// At most how many runs the clients make (sessions of one to three runs each); no new
    /// session starts once the kills have stopped.
    pub runs: usize,
    /// Sessions driven at once.
    pub concurrency: usize,
    /// `ratchet worker` processes beside `ratchet serve`; each is killed like the server.
    pub worker_processes: usize,
    /// Kills happen after a random uptime in this range.
    pub uptime_ms: (u64, u64),
    pub seed: u64,
    /// Where the database file, the workspace, the configurations and the processes' logs go.
    pub dir: PathBuf,
    /// After the kills stop, how long the runs still going get to finish.
    pub settle: Duration,
}

#[derive(Debug)]
pub struct Report {
    pub seed: u64,
    pub kills: usize,
    pub tally: Tally,
    pub model_calls: u64,
    pub compactions: u64,
    pub chaos: Duration,
    pub violations: Vec<String>,
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "runs {}, kills {}, steps {}, violations {}",
            self.tally.runs,
            self.kills,
            self.tally.steps,
            self.violations.len()
        )?;
        writeln!(
            f,
            "seed {}; {:.1} s of kills; {} events checked; {} model calls, {} summaries asked for ({} hidden messages); {} never-replay effects",
            self.seed,
            self.chaos.as_secs_f64(),
            self.tally.events,
            self.model_calls,
            self.compactions,
            self.tally.hidden_messages,
            self.tally.appends
        )?;
        let reasons: Vec<String> = self
            .tally
            .stop_reasons
            .iter()
            .map(|(reason, count)| format!("{reason} {count}"))
            .collect();
        let executions: Vec<String> = self
            .tally
            .mcp_executions
            .iter()
            .map(|(tool, count)| format!("{tool} {count}"))
            .collect();
        writeln!(
            f,
            "MCP calls executed: {}; {} keyed retries answered from the first execution; {} calls in doubt held against the model's requests",
            executions.join(", "),
            self.tally.keyed_replays,
            self.tally.calls_in_doubt
        )?;
        writeln!(
            f,
            "background: {} helper runs; {} reports told by a continuation, {} dead-lettered; {} interrupting messages",
            self.tally.children,
            self.tally.reports_told,
            self.tally.reports_dead,
            self.tally.interrupts
        )?;
        writeln!(
            f,
            "keyed messages: {} sent again after no answer, {} answered with the kept response",
            self.tally.message_resends, self.tally.message_replays
        )?;
        writeln!(
            f,
            "durable timers: {} set, {} woken early by input; schedule: {} slots fired, one run each",
            self.tally.timers_set, self.tally.timers_woken_by_input, self.tally.scheduled_slots
        )?;
        writeln!(
            f,
            "cancels: {} cut a batch off, {} ended a step a worker process ran; {} results told a call (never started) it was not run",
            self.tally.cut_off_batches,
            self.tally.cancels_across_processes,
            self.tally.told_not_run
        )?;
        writeln!(
            f,
            "keyed schedules and webhooks: {} created across kills, {} sent again after no answer, one each",
            self.tally.keyed_creations, self.tally.keyed_creation_resends
        )?;
        writeln!(f, "stop reasons: {}", reasons.join(", "))?;
        let paths: Vec<String> = self
            .tally
            .events_of_kind
            .iter()
            .map(|(kind, count)| format!("{kind} {count}"))
            .collect();
        writeln!(f, "paths taken: {}", paths.join(", "))?;
        for violation in &self.violations {
            writeln!(f, "VIOLATION {violation}")?;
        }
        Ok(())
    }
}

/// How often the chaos schedule fires.
const SCHEDULE_EVERY_MS: i64 = 1000;
/// How often, all through the kills, a schedule and a webhook are created under keys of their
/// own (each sent again across kills until it is answered).
const KEYED_CREATION_EVERY: Duration = Duration::from_secs(4);

pub async fn run(options: Options) -> anyhow::Result<Report> {
    let stop_model = CancellationToken::new();
    let _stop_model = stop_model.clone().drop_guard();
    let model = ModelState::default();
    let model_url = model::serve(model.clone(), stop_model).await?;
    let db_url = match &options.database {
        Database::Sqlite => format!("sqlite://{}", options.dir.join("chaos.db").display()),
        Database::Postgres { url } => url.clone(),
    };
    let spec = FleetSpec {
        ratchet: options.ratchet.clone(),
        dir: options.dir.clone(),
        db_url: db_url.clone(),
        model_url,
        port: free_port()?,
        worker_processes: options.worker_processes,
    };
    let mut fleet = Fleet::start(spec.clone()).await?;
    let store = open_store(&options.database, &db_url).await?;
    let deadline = Instant::now() + options.duration + options.settle;
    let clients = Arc::new(Clients::new(
        spec.api(),
        Arc::clone(&store),
        model.clone(),
        spec.workspace(),
        spec.mcp_log(),
        deadline,
    )?);

    // A schedule fires a run every second all through the chaos, on whichever process
    // reaches each slot first.
    model.add_plan(&Plan::scheduled());
    let schedule = clients
        .create_schedule(&json!({
            "message": Plan::scheduled().user_message(),
            "every_ms": SCHEDULE_EVERY_MS,
            "session": "new",
            "overlap": "enqueue",
            "catch_up": "all",
        }))
        .await
        .context("creating the chaos schedule")?;
    let schedule_client = Arc::clone(&clients);

    let mut rng = fastrand::Rng::with_seed(options.seed);
    let sessions = sessions_of_plans(options.runs, &mut rng);
    let clients_done = CancellationToken::new();
    let kills_over = CancellationToken::new();
    let driving = {
        let clients_done = clients_done.clone();
        let kills_over = kills_over.clone();
        let concurrency = options.concurrency.max(1);
        tokio::spawn(async move {
            let logs: Vec<_> = futures::stream::iter(sessions)
                .take_until(kills_over.cancelled_owned())
                .map(|session| tokio::spawn(Arc::clone(&clients).drive_session(session)))
                .buffer_unordered(concurrency)
                .collect()
                .await;
            clients_done.cancel();
            logs
        })
    };

    let creating = tokio::spawn(create_keyed(
        Arc::clone(&schedule_client),
        kills_over.clone(),
    ));

    let started = Instant::now();
    let mut kills = 0;
    while started.elapsed() < options.duration && !clients_done.is_cancelled() {
        let uptime = Duration::from_millis(rng.u64(options.uptime_ms.0..=options.uptime_ms.1));
        tokio::select! {
            () = tokio::time::sleep(uptime) => {}
            () = clients_done.cancelled() => break,
        }
        let which = rng.usize(0..fleet.processes());
        let downtime = Duration::from_millis(rng.u64(0..300));
        fleet
            .kill_and_restart(which, downtime)
            .await
            .context("restarting after a kill")?;
        kills += 1;
    }
    let chaos = started.elapsed();
    kills_over.cancel();

    let mut logs = Vec::new();
    for joined in driving.await? {
        logs.push(joined.context("a client task panicked")?);
    }
    schedule_client
        .settle_schedule(&schedule)
        .await
        .context("pausing the chaos schedule")?;
    let created = creating
        .await?
        .context("creating keyed schedules and webhooks")?;
    let webhooks = schedule_client.webhooks().await?;
    fleet.stop().await?;

    let rounds_asked = model.rounds_asked();
    let told_not_run = model.told_not_run();
    let evidence = check::Evidence {
        logs: &logs,
        workspace: &spec.workspace(),
        mcp_log: &spec.mcp_log(),
        rounds_asked: &rounds_asked,
        told_not_run: &told_not_run,
        worker_pids: fleet.worker_pids(),
    };
    let (mut tally, mut violations) = check::check(store.as_ref(), &evidence).await?;
    check::check_schedule(
        store.as_ref(),
        &schedule,
        SCHEDULE_EVERY_MS,
        &mut tally,
        &mut violations,
    )
    .await?;
    check::check_keyed_creations(
        store.as_ref(),
        &created,
        &webhooks,
        &mut tally,
        &mut violations,
    )
    .await?;
    violations.extend(model.violations());
    violations.extend(logs.iter().flat_map(|log| log.problems.iter().cloned()));
    Ok(Report {
        seed: options.seed,
        kills,
        tally,
        model_calls: model.calls(),
        compactions: model.summaries(),
        chaos,
        violations,
    })
}

/// Creates a paused schedule and a webhook (sent only `session.closed`, which the chaos never
/// writes) every `KEYED_CREATION_EVERY` until `stop`, each under a key of its own.
async fn create_keyed(
    clients: Arc<Clients>,
    stop: CancellationToken,
) -> anyhow::Result<check::KeyedCreations> {
    let mut created = check::KeyedCreations::default();
    for i in 1.. {
        tokio::select! {
            () = tokio::time::sleep(KEYED_CREATION_EVERY) => {}
            () = stop.cancelled() => break,
        }
        let message = format!("keyed schedule {i}");
        let body = json!({"message": message, "every_ms": 3_600_000, "session": "new",
            "overlap": "enqueue", "catch_up": "skip", "paused": true});
        let sent = (clients.keyed_post("/v1/schedules", &format!("schedule-{i}"), &body)).await?;
        created.resends += sent.resends;
        created.schedules.push((message, id_in(&sent.answer)?));
        let url = format!("http://127.0.0.1:9/keyed-{i}");
        let body = json!({"url": url, "events": ["session.closed"]});
        let sent = (clients.keyed_post("/v1/webhooks", &format!("webhook-{i}"), &body)).await?;
        created.resends += sent.resends;
        created.webhooks.push((url, id_in(&sent.answer)?));
    }
    Ok(created)
}

fn id_in(answer: &serde_json::Value) -> anyhow::Result<String> {
    (answer["id"].as_str().map(str::to_owned)).with_context(|| format!("no id in {answer}"))
}

/// `runs` plans in sessions of one to three runs; tags name the session and the run. One
/// session in four is the dispatcher's, whose runs start background work.
fn sessions_of_plans(runs: usize, rng: &mut fastrand::Rng) -> Vec<SessionPlan> {
    let mut sessions = Vec::new();
    let mut made = 0;
    while made < runs {
        let size = rng.usize(1..=3).min(runs - made);
        let session = sessions.len();
        let dispatching = rng.u8(0..4) == 0;
        let plans = (0..size)
            .map(|run| {
                let tag = format!("s{session}r{run}");
                match dispatching {
                    true => Plan::dispatching(tag, rng),
                    false => Plan::random(tag, rng),
                }
            })
            .collect();
        sessions.push(SessionPlan {
            agent: dispatching.then_some(DISPATCHER),
            plans,
        });
        made += size;
    }
    sessions
}

/// The store as the processes share it; the chaos process only reads (never migrates).
async fn open_store(database: &Database, url: &str) -> anyhow::Result<Arc<dyn Reads>> {
    let url = url.to_owned();
    let database = database.clone();
    tokio::task::spawn_blocking(move || -> anyhow::Result<Arc<dyn Reads>> {
        Ok(match database {
            Database::Sqlite => {
                let options = ratchet_sqlite::SqliteOptions {
                    migrate: false,
                    ..ratchet_sqlite::SqliteOptions::from_url(&url)?
                };
                Arc::new(ratchet_sqlite::open(options)?)
            }
            Database::Postgres { .. } => {
                let options = ratchet_postgres::PgOptions {
                    migrate: false,
                    ..ratchet_postgres::PgOptions::from_url(&url)?
                };
                Arc::new(ratchet_postgres::open(options)?)
            }
        })
    })
    .await?
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}
