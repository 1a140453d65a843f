//! The Ratchet processes under test: one `ratchet serve` (the API and workers) and any number
//! of `ratchet worker`s over the same database. The fleet kills them with SIGKILL and starts
//! them again; each start writes a new configuration *generation* whose budget differs from
//! the last, so a run whose frozen configuration were ever rewritten would show it.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use tokio::process::{Child, Command};

/// What every process of the fleet is started with.
#[derive(Debug, Clone)]
pub struct FleetSpec {
    pub ratchet: PathBuf,
    pub dir: PathBuf,
    pub db_url: String,
    pub model_url: String,
    pub port: u16,
    /// `ratchet worker` processes beside the server.
    pub worker_processes: usize,
}

impl FleetSpec {
    pub fn workspace(&self) -> PathBuf {
        self.dir.join("workspace")
    }

    pub fn api(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The directory where the chaos MCP server records every call it executes, a file each.
    pub fn mcp_log(&self) -> PathBuf {
        self.dir.join("mcp-calls")
    }

    fn mcp_script(&self) -> PathBuf {
        self.dir.join("chaos_mcp_server.py")
    }

    fn agents(&self) -> PathBuf {
        self.dir.join("agents")
    }
}

/// The catalog: the dispatcher delegates in the background to helpers; both talk to the
/// chaos model. A child is offered only tools that may be delegated (`add`, `sleep_ms`).
fn write_catalog(dir: &std::path::Path) -> std::io::Result<()> {
    use crate::plan::{DISPATCHER, HELPER};
    std::fs::create_dir_all(dir)?;
    std::fs::write(
        dir.join(format!("{DISPATCHER}.md")),
        format!(
            "---\nid: {DISPATCHER}\ndescription: starts background work\nmodel: openai:chaos\n\
             tools: [add, sleep_ms, append_line]\ndelegates: [{HELPER}]\n---\nYou dispatch.\n"
        ),
    )?;
    std::fs::write(
        dir.join(format!("{HELPER}.md")),
        format!(
            "---\nid: {HELPER}\ndescription: does one task\nmodel: openai:chaos\n\
             tools: [add, sleep_ms]\n---\nYou help.\n"
        ),
    )
}

/// The chaos MCP server, written next to the configurations so that the program needs
/// nothing but `python3` beside it.
const MCP_SERVER_SCRIPT: &str = include_str!("../mcp_server.py");

/// How long the chaos MCP server may hold a call before its outcome is unknown.
pub const MCP_TIMEOUT_MS: u64 = 400;
/// Attempts of a `keyed` call whose outcome stays unknown before a human is asked.
pub const FLAKY_MAX_ATTEMPTS: u64 = 3;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Serve,
    Worker,
}

struct Process {
    role: Role,
    index: usize,
    child: Child,
}

pub struct Fleet {
    spec: FleetSpec,
    /// The key every generation's server seals webhook secrets with (PostgreSQL needs one).
    secrets_key: String,
    processes: Vec<Process>,
    generation: u64,
    http: reqwest::Client,
    /// The pid of every `ratchet worker` process started, killed ones too.
    worker_pids: Vec<u32>,
}

/// How long a process may take to answer `/readyz` after it starts.
const START_DEADLINE: Duration = Duration::from_secs(30);

impl Fleet {
    pub async fn start(spec: FleetSpec) -> anyhow::Result<Fleet> {
        for dir in [crate::plan::LOG_DIR, crate::plan::GATED_DIR] {
            std::fs::create_dir_all(spec.workspace().join(dir))?;
        }
        std::fs::write(spec.mcp_script(), MCP_SERVER_SCRIPT)?;
        write_catalog(&spec.agents())?;
        let mut fleet = Fleet {
            spec,
            secrets_key: ratchet_store::Key::generate()?.to_hex(),
            processes: Vec::new(),
            generation: 0,
            worker_pids: Vec::new(),
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(2))
                .build()?,
        };
        // The server migrates the database first; workers start against a ready schema.
        let serve = fleet.spawn(Role::Serve, 0).await?;
        fleet.processes.push(serve);
        for index in 0..fleet.spec.worker_processes {
            let worker = fleet.spawn(Role::Worker, index).await?;
            fleet.processes.push(worker);
        }
        Ok(fleet)
    }

    pub fn processes(&self) -> usize {
        self.processes.len()
    }

    /// The pid of every `ratchet worker` process it started: a step committed by one of them
    /// ran in another process than the API that took the run's requests.
    pub fn worker_pids(&self) -> &[u32] {
        &self.worker_pids
    }

    /// SIGKILLs process `which` (no grace: whatever it was doing stops mid-instruction),
    /// waits `downtime`, and starts a fresh one in its place.
    pub async fn kill_and_restart(
        &mut self,
        which: usize,
        downtime: Duration,
    ) -> anyhow::Result<()> {
        let process = &mut self.processes[which];
        process.child.start_kill().context("sending SIGKILL")?;
        process.child.wait().await?;
        let (role, index) = (process.role, process.index);
        tokio::time::sleep(downtime).await;
        self.processes[which] = self.spawn(role, index).await?;
        Ok(())
    }

    /// Stops every process with SIGTERM (in-flight steps commit) and waits for it to exit.
    pub async fn stop(&mut self) -> anyhow::Result<()> {
        for process in &mut self.processes {
            if let Some(pid) = process.child.id() {
                Command::new("kill")
                    .args(["-TERM", &pid.to_string()])
                    .status()
                    .await?;
            }
            let waited = tokio::time::timeout(Duration::from_secs(20), process.child.wait()).await;
            if waited.is_err() {
                process.child.start_kill()?;
                bail!(
                    "a {:?} process did not stop within 20 s of SIGTERM",
                    process.role
                );
            }
        }
        Ok(())
    }

    async fn spawn(&mut self, role: Role, index: usize) -> anyhow::Result<Process> {
        self.generation += 1;
        let config = self
            .spec
            .dir
            .join(format!("ratchet-{}.toml", self.generation));
        std::fs::write(&config, config_text(&self.spec, self.generation))?;
        let log_name = match role {
            Role::Serve => "serve.log".to_owned(),
            Role::Worker => format!("worker-{index}.log"),
        };
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.spec.dir.join(log_name))?;
        let command = match role {
            Role::Serve => "serve",
            Role::Worker => "worker",
        };
        let child = Command::new(&self.spec.ratchet)
            .arg(command)
            .arg("--config")
            .arg(&config)
            .env("OPENAI_BASE_URL", &self.spec.model_url)
            .env("OPENAI_API_KEY", "chaos")
            .env("RATCHET_SECRETS_KEY", &self.secrets_key)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {}", self.spec.ratchet.display()))?;
        if role == Role::Serve {
            self.wait_ready().await?;
        }
        if role == Role::Worker {
            self.worker_pids.extend(child.id());
        }
        Ok(Process { role, index, child })
    }

    async fn wait_ready(&self) -> anyhow::Result<()> {
        let url = format!("{}/readyz", self.spec.api());
        let started = Instant::now();
        while started.elapsed() < START_DEADLINE {
            if let Ok(response) = self.http.get(&url).send().await
                && response.status().is_success()
            {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        bail!(
            "the server did not become ready within {START_DEADLINE:?}; see {}",
            self.spec.dir.join("serve.log").display()
        )
    }
}

/// The configuration of one generation. Leases are short so that a killed process's steps
/// are taken over quickly; appends under `approve/` wait for a human; the prompt budget is
/// small enough that long sessions are compacted (their summaries are hidden messages). The
/// chaos MCP server's tools run without approval, `never` replay but `flaky` (`keyed`), and
/// its timeout is short, so that calls whose outcome is unknown are frequent. A report whose
/// continuation fails is offered again soon and dead-lettered after its second attempt. A
/// keyed message whose process was killed holds its key for two seconds only.
fn config_text(spec: &FleetSpec, generation: u64) -> String {
    format!(
        r#"db = {db:?}
agents = {agents:?}
listen = "127.0.0.1:{port}"
model = "openai:chaos"
workspace = {workspace:?}
max_steps = {max_steps}
max_prompt_tokens = 300
workers = 16
lease_ms = 1500
heartbeat_ms = 300
poll_ms = 100

[tools.append_line]
approval = {{ path = "{gated}/**" }}

[api]
idempotency_hold_ms = 2000

[inbox]
max_attempts = 2
retry_backoff_ms = 200

[mcp.servers.{server}]
command = "python3"
args = [{script:?}]
env = {{ CHAOS_MCP_LOG = {mcp_log:?} }}
timeout_ms = {MCP_TIMEOUT_MS}
replay = "never"
approval = "never"

[tools."{flaky}"]
replay = "keyed"
max_attempts = {FLAKY_MAX_ATTEMPTS}
"#,
        server = crate::plan::MCP_SERVER,
        script = spec.mcp_script().display().to_string(),
        mcp_log = spec.mcp_log().display().to_string(),
        flaky = crate::plan::FLAKY_TOOL,
        db = spec.db_url,
        agents = spec.agents().display().to_string(),
        port = spec.port,
        workspace = spec.workspace().display().to_string(),
        max_steps = 40 + generation % 7,
        gated = crate::plan::GATED_DIR,
    )
}
