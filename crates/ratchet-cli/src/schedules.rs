//! `ratchet schedules …`: a server's schedules — create, list, show, change, delete, pause,
//! resume, fire now — and what each slot became. Always through a server: a schedule freezes
//! the configuration of the server's catalog, which only the server knows.

use std::io::Write;
use std::process::ExitCode;

use clap::{Args, Subcommand, ValueEnum};
use ratchet_client::Api;
use serde_json::{Map, Value, json};

#[derive(Debug, Args)]
pub struct ServerArgs {
    /// The Ratchet server's URL.
    #[arg(long, value_name = "URL", default_value = "http://127.0.0.1:7700")]
    server: String,
    /// Bearer token for the server.
    #[arg(
        long,
        value_name = "TOKEN",
        env = "RATCHET_TOKEN",
        hide_env_values = true
    )]
    token: Option<String>,
    /// Print the server's JSON answer instead of a summary.
    #[arg(long)]
    json: bool,
}

impl ServerArgs {
    fn api(&self) -> anyhow::Result<Api> {
        Ok(Api::new(&self.server, self.token.clone(), 2)?)
    }
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum OverlapArg {
    Skip,
    Enqueue,
    CancelPrevious,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum CatchUpArg {
    Skip,
    One,
    All,
}

impl OverlapArg {
    fn name(self) -> &'static str {
        match self {
            OverlapArg::Skip => "skip",
            OverlapArg::Enqueue => "enqueue",
            OverlapArg::CancelPrevious => "cancel_previous",
        }
    }
}

impl CatchUpArg {
    fn name(self) -> &'static str {
        match self {
            CatchUpArg::Skip => "skip",
            CatchUpArg::One => "one",
            CatchUpArg::All => "all",
        }
    }
}

/// The fields a schedule is defined with; on `update`, those given replace the schedule's.
#[derive(Debug, Args)]
pub struct Definition {
    /// A cron expression: 5 fields (minute hour day-of-month month day-of-week) or 6 (seconds
    /// first).
    #[arg(long, conflicts_with = "every_ms")]
    cron: Option<String>,
    /// An interval in milliseconds (at least 1000), at its multiples since the Unix epoch.
    #[arg(long, value_name = "MS")]
    every_ms: Option<u64>,
    /// The IANA time zone the cron expression is read in [default: UTC].
    #[arg(long, value_name = "ZONE")]
    timezone: Option<String>,
    /// `new` (each run in a new session) or a session id every run goes to.
    #[arg(long, value_name = "new|SES_ID")]
    session: Option<String>,
    /// What a slot does while the previous run has not finished.
    #[arg(long, value_enum)]
    overlap: Option<OverlapArg>,
    /// What becomes of the slots missed while no scheduler ran.
    #[arg(long, value_enum)]
    catch_up: Option<CatchUpArg>,
    /// The catalog agent its runs are of.
    #[arg(long, value_name = "ID")]
    agent: Option<String>,
}

impl Definition {
    fn body(self, message: Option<String>, paused: Option<bool>) -> Value {
        let mut body = Map::new();
        let mut put = |key: &str, value: Option<Value>| {
            if let Some(value) = value {
                body.insert(key.to_owned(), value);
            }
        };
        put("message", message.map(Value::from));
        put("cron", self.cron.map(Value::from));
        put("every_ms", self.every_ms.map(Value::from));
        put("timezone", self.timezone.map(Value::from));
        put("session", self.session.map(Value::from));
        put("overlap", self.overlap.map(|o| Value::from(o.name())));
        put("catch_up", self.catch_up.map(|c| Value::from(c.name())));
        put("agent", self.agent.map(Value::from));
        put("paused", paused.map(Value::from));
        Value::Object(body)
    }
}

#[derive(Debug, Args)]
pub struct CreateArgs {
    #[command(flatten)]
    definition: Definition,
    /// Create it paused: it fires nothing until resumed.
    #[arg(long)]
    paused: bool,
    #[command(flatten)]
    server: ServerArgs,
    /// The message each run starts with.
    message: String,
}

#[derive(Debug, Args)]
pub struct UpdateArgs {
    id: String,
    #[command(flatten)]
    definition: Definition,
    /// A new message.
    #[arg(long)]
    message: Option<String>,
    #[command(flatten)]
    server: ServerArgs,
}

#[derive(Debug, Args)]
pub struct OneArgs {
    id: String,
    #[command(flatten)]
    server: ServerArgs,
}

#[derive(Debug, Args)]
pub struct RunsArgs {
    id: String,
    /// The latest this many slots.
    #[arg(long, default_value_t = 50)]
    limit: u32,
    #[command(flatten)]
    server: ServerArgs,
}

#[derive(Debug, Subcommand)]
pub enum SchedulesCommand {
    /// Create a schedule: MESSAGE sent on a cadence (`--cron` or `--every-ms`), with
    /// `--session`, `--overlap` and `--catch-up` (all three required).
    Create(CreateArgs),
    /// List the schedules.
    List(ServerArgs),
    /// Show one schedule.
    Get(OneArgs),
    /// Change a schedule: each option given replaces what it has.
    Update(UpdateArgs),
    /// Delete a schedule; the runs it fired stay.
    Delete(OneArgs),
    /// Pause a schedule: it fires nothing by its cadence until resumed.
    Pause(OneArgs),
    /// Resume a schedule from its next slot (the slots of the pause are not caught up).
    Resume(OneArgs),
    /// Fire a schedule now, as a manual slot.
    Trigger(OneArgs),
    /// What each of a schedule's slots became, newest first.
    Runs(RunsArgs),
}

impl SchedulesCommand {
    pub async fn execute(self) -> anyhow::Result<ExitCode> {
        let mut out = std::io::stdout().lock();
        match self {
            SchedulesCommand::Create(args) => {
                let missing: Vec<&str> = [
                    (args.definition.session.is_none(), "--session"),
                    (args.definition.overlap.is_none(), "--overlap"),
                    (args.definition.catch_up.is_none(), "--catch-up"),
                ]
                .into_iter()
                .filter_map(|(missing, flag)| missing.then_some(flag))
                .collect();
                if !missing.is_empty() {
                    anyhow::bail!("a schedule needs {}", missing.join(", "));
                }
                let api = args.server.api()?;
                let body = args.definition.body(Some(args.message), Some(args.paused));
                let created = api.create_schedule(&body).await?;
                show(&mut out, &args.server, &created, summary)?;
            }
            SchedulesCommand::List(server) => {
                let all = server.api()?.schedules().await?;
                if server.json {
                    writeln!(out, "{}", Value::from(all))?;
                } else if all.is_empty() {
                    writeln!(out, "no schedules")?;
                } else {
                    for schedule in &all {
                        writeln!(out, "{}", summary(schedule))?;
                    }
                }
            }
            SchedulesCommand::Get(args) => {
                let schedule = args.server.api()?.schedule(&args.id).await?;
                show(&mut out, &args.server, &schedule, summary)?;
            }
            SchedulesCommand::Update(args) => {
                let body = args.definition.body(args.message, None);
                let api = args.server.api()?;
                let updated = api.update_schedule(&args.id, &body).await?;
                show(&mut out, &args.server, &updated, summary)?;
            }
            SchedulesCommand::Delete(args) => {
                args.server.api()?.delete_schedule(&args.id).await?;
                if args.server.json {
                    writeln!(out, "{}", json!({"id": args.id, "deleted": true}))?;
                } else {
                    writeln!(out, "{} is deleted", args.id)?;
                }
            }
            SchedulesCommand::Pause(args) => {
                let api = args.server.api()?;
                let paused = api.schedule_action(&args.id, "pause").await?;
                show(&mut out, &args.server, &paused, summary)?;
            }
            SchedulesCommand::Resume(args) => {
                let api = args.server.api()?;
                let resumed = api.schedule_action(&args.id, "resume").await?;
                show(&mut out, &args.server, &resumed, summary)?;
            }
            SchedulesCommand::Trigger(args) => {
                let api = args.server.api()?;
                let slot = api.schedule_action(&args.id, "trigger").await?;
                show(&mut out, &args.server, &slot, slot_line)?;
            }
            SchedulesCommand::Runs(args) => {
                let slots = args
                    .server
                    .api()?
                    .schedule_runs(&args.id, args.limit)
                    .await?;
                if args.server.json {
                    writeln!(out, "{}", Value::from(slots))?;
                } else if slots.is_empty() {
                    writeln!(out, "no slot decided yet")?;
                } else {
                    for slot in &slots {
                        writeln!(out, "{}", slot_line(slot))?;
                    }
                }
            }
        }
        Ok(ExitCode::SUCCESS)
    }
}

fn show(
    out: &mut impl Write,
    server: &ServerArgs,
    value: &Value,
    line: fn(&Value) -> String,
) -> anyhow::Result<()> {
    if server.json {
        writeln!(out, "{value}")?;
    } else {
        writeln!(out, "{}", line(value))?;
    }
    Ok(())
}

/// One line per schedule: its id, cadence, where its runs go, its rules and when it is due.
fn summary(schedule: &Value) -> String {
    let text = |key: &str| schedule[key].as_str().unwrap_or_default().to_owned();
    let cadence = match (schedule["cron"].as_str(), schedule["every_ms"].as_u64()) {
        (Some(cron), _) => match schedule["timezone"].as_str() {
            Some(zone) => format!("cron {cron:?} in {zone}"),
            None => format!("cron {cron:?}"),
        },
        (None, Some(ms)) => format!("every {ms} ms"),
        (None, None) => "no cadence".to_owned(),
    };
    let due = if schedule["paused"] == true {
        "paused".to_owned()
    } else {
        match schedule["next_fire_at"].as_i64() {
            Some(at) => format!("next at {at}"),
            None => "never due again".to_owned(),
        }
    };
    format!(
        "{}  {cadence}  session {}  overlap {}  catch_up {}  {due}  {:?}",
        text("id"),
        text("session"),
        text("overlap"),
        text("catch_up"),
        text("message"),
    )
}

/// One line per decided slot: when, what it became, and its run or why not.
fn slot_line(slot: &Value) -> String {
    let kind = if slot["manual"] == true {
        " (manual)"
    } else {
        ""
    };
    let outcome = slot["outcome"].as_str().unwrap_or_default();
    let detail = match (slot["run_id"].as_str(), slot["reason"].as_str()) {
        (Some(run), _) => format!("{run} {}", slot["status"].as_str().unwrap_or_default()),
        (None, Some(reason)) => reason.to_owned(),
        (None, None) => String::new(),
    };
    format!("{}{kind}  {outcome}  {detail}", slot["slot"])
}
