//! The runtime inside a program: [`Ratchet`], built with [`Ratchet::builder`].

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use futures::Stream;
use ratchet_core::{
    AgentState, ApprovalAnswer, ApprovalCall, ApprovalId, CallDecision, HumanRequest, Limits,
    MemoryScope, RunConfigSnapshot, RunId, RunStatus, SessionId, StopReason,
};
use ratchet_engine::{Multitask, PoolConfig, WorkerPool};
use ratchet_llm::Model;
use ratchet_server::{Active, AppState, Tokens, hash_token};
use ratchet_store::StoredEvent;
use ratchet_store::{Reads, SessionSpec};
use ratchet_tools::{DEFAULT_MAX_SNIPPET_BYTES, Registry, Tool};
use tokio::sync::broadcast;
use tokio::sync::broadcast::error::RecvError;
use tokio_util::sync::CancellationToken;

use crate::config::token_problem;
use crate::runtime::{Runtime, Schema, ToolOverrides, Toolbox, open_store};
use crate::{Error, Result};

/// A durable agent runtime running in this process: its store, its tools and its workers.
/// Every run it starts survives a crash of the process: build it again on the same database
/// and the run goes on from its last committed step.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> ratchet::Result<()> {
/// # let dir = tempfile::tempdir().unwrap();
/// # let url = format!("sqlite://{}", dir.path().join("agents.db").display());
/// let ratchet = ratchet::Ratchet::builder()
///     .database(&url)
///     .model("scripted:demo") // the built-in demo model; or "openai:gpt-4.1-mini", a profile…
///     .workspace(dir.path())
///     .build()
///     .await?;
/// let run = ratchet.session().await?.send("What is 2 + 3?").await?;
/// let outcome = run.wait().await?;
/// assert!(outcome.answer.unwrap().starts_with("2 + 3 = 5"));
/// ratchet.shutdown().await;
/// # Ok(())
/// # }
/// ```
pub struct Ratchet {
    runtime: Runtime,
    workers: WorkerPool,
    template: RunConfigSnapshot,
    tokens: Tokens,
    /// Cancelled at shutdown: the HTTP API's event streams end.
    stopping: CancellationToken,
}

/// How a [`Ratchet`] is made: every setting has a default but the database.
pub struct Builder {
    database: Option<String>,
    model: String,
    tools: Vec<Arc<dyn Tool>>,
    /// A model the program implements itself, by the name runs are frozen with.
    own_model: Option<(String, Arc<dyn Model>)>,
    workspace: Option<PathBuf>,
    limits: Limits,
    system_prompt: Option<String>,
    workers: usize,
    /// Tenant by token, checked when the runtime is built.
    tokens: Vec<(String, String)>,
}

impl Ratchet {
    pub fn builder() -> Builder {
        Builder {
            database: None,
            model: "scripted:demo".to_owned(),
            tools: Vec::new(),
            own_model: None,
            workspace: None,
            limits: Limits::default(),
            system_prompt: None,
            workers: 4,
            tokens: Vec::new(),
        }
    }

    /// The HTTP API and the web console over this runtime, to serve with `axum::serve`: the
    /// same API `ratchet serve` has, its runs frozen with this runtime's model and tools.
    /// Without [`Builder::token`] every request is the default tenant's and only loopback
    /// names are answered, so serve it on a loopback address.
    pub fn app(&self) -> axum::Router {
        let active = Active::new(self.template.clone(), Vec::new(), self.tokens.clone());
        let state = AppState::new(
            Arc::clone(&self.runtime.coordinator),
            Arc::clone(&self.runtime.webhooks),
            active,
            self.stopping.clone(),
        );
        ratchet_server::app(state)
    }

    /// A new conversation; each message sent in it starts a run.
    pub async fn session(&self) -> Result<Session<'_>> {
        let session = (self.runtime.coordinator)
            .create_session(SessionSpec::default())
            .await
            .map_err(|cause| Error::Runtime {
                what: "creating a session".to_owned(),
                cause,
            })?;
        Ok(Session {
            ratchet: self,
            id: session.id,
        })
    }

    /// The run `id`, started earlier — by this program before it crashed, say.
    pub fn run(&self, id: RunId) -> Run<'_> {
        Run { ratchet: self, id }
    }

    /// The store every run is kept in, for reading what they did.
    pub fn store(&self) -> &Arc<dyn Reads> {
        self.runtime.coordinator.store()
    }

    /// Stops taking steps, lets the steps in flight commit, and closes the tools.
    pub async fn shutdown(self) {
        self.stopping.cancel();
        self.workers.shutdown().await;
        self.runtime.close_tools().await;
    }
}

impl Builder {
    /// Where runs are kept: `sqlite://PATH` (made if missing) or
    /// `postgres://USER@HOST:PORT/DATABASE`.
    pub fn database(mut self, url: &str) -> Builder {
        self.database = Some(url.to_owned());
        self
    }

    /// The model runs call: `openai:MODEL`, `anthropic:MODEL`, `scripted:demo` (the default),
    /// or `scripted:PATH` to a script of replies.
    pub fn model(mut self, spec: &str) -> Builder {
        self.model = spec.to_owned();
        self
    }

    /// A model this program implements, which runs call instead of a provider's. `name` is
    /// what each run is frozen with: a run started under this name needs a process that has
    /// a model of that name to go on after a crash.
    pub fn model_impl(mut self, name: &str, model: impl Model + 'static) -> Builder {
        self.model = name.to_owned();
        self.own_model = Some((name.to_owned(), Arc::new(model)));
        self
    }

    /// A tool runs may call, besides the built-in ones; see [`crate::tool_fn`].
    pub fn tool(mut self, tool: impl Tool + 'static) -> Builder {
        self.tools.push(Arc::new(tool));
        self
    }

    /// The directory file tools are confined to; the current directory by default.
    pub fn workspace(mut self, dir: impl Into<PathBuf>) -> Builder {
        self.workspace = Some(dir.into());
        self
    }

    /// The budgets every run is frozen with.
    pub fn limits(mut self, limits: Limits) -> Builder {
        self.limits = limits;
        self
    }

    pub fn system_prompt(mut self, prompt: &str) -> Builder {
        self.system_prompt = Some(prompt.to_owned());
        self
    }

    /// A token the HTTP API ([`Ratchet::app`]) accepts, for `tenant`; with none, the API asks
    /// for no token.
    /// A token must be at least 16 characters with no whitespace, as in `ratchet.toml`.
    pub fn token(mut self, tenant: &str, token: &str) -> Builder {
        self.tokens.push((tenant.to_owned(), token.to_owned()));
        self
    }

    /// How many steps this process runs at once (4 by default).
    pub fn workers(mut self, workers: usize) -> Builder {
        self.workers = workers;
        self
    }

    /// Checks the settings, opens (and migrates) the database, takes over the steps of this
    /// machine's dead processes and starts the workers. Must be called inside a tokio runtime.
    pub async fn build(self) -> Result<Ratchet> {
        let database = self.database.ok_or_else(|| {
            Error::Invalid("a database is needed: call .database(\"sqlite://PATH\")".to_owned())
        })?;
        let mut tokens = HashMap::new();
        for (tenant, token) in &self.tokens {
            if tenant.trim().is_empty() {
                return Err(Error::Invalid("a token's tenant is empty".to_owned()));
            }
            if let Some(problem) = token_problem(token) {
                return Err(Error::Invalid(format!(
                    "the token of tenant {tenant:?} {problem}"
                )));
            }
            tokens.insert(hash_token(token), tenant.clone());
        }
        if self.workers == 0 {
            return Err(Error::Invalid(
                "workers must be at least 1, found 0".to_owned(),
            ));
        }
        let tools = [
            Registry::builtin_tools(DEFAULT_MAX_SNIPPET_BYTES),
            self.tools,
        ]
        .concat();
        let toolbox = Toolbox::of(Registry::new(tools)?, None);
        if let Some((name, model)) = self.own_model {
            toolbox.models.register(&name, model);
        }
        let mut template = toolbox.run_template(
            &self.model,
            self.workspace.as_deref(),
            self.limits,
            &ToolOverrides::default(),
            MemoryScope::Session,
        )?;
        if let Some(prompt) = self.system_prompt {
            template.system_prompt = prompt;
        }
        let store = open_store(&database, Schema::Migrate)?;
        let runtime = Runtime::new(store, toolbox);
        let workers = runtime
            .recover_and_start(PoolConfig {
                workers: self.workers,
                ..PoolConfig::default()
            })
            .await?;
        Ok(Ratchet {
            runtime,
            workers,
            template,
            tokens: Tokens::new(tokens),
            stopping: CancellationToken::new(),
        })
    }
}

async fn read_state(ratchet: &Ratchet, run: &RunId) -> Result<AgentState> {
    (ratchet.store().load_state(run).await).map_err(|cause| Error::Store {
        what: format!("reading run {run}"),
        cause,
    })
}

/// A conversation: its messages start runs, one at a time.
pub struct Session<'a> {
    ratchet: &'a Ratchet,
    id: SessionId,
}

impl<'a> Session<'a> {
    pub fn id(&self) -> &SessionId {
        &self.id
    }

    /// Records the message and its run, durably, before returning: the run starts at once,
    /// or after the session's active run.
    pub async fn send(&self, message: &str) -> Result<Run<'a>> {
        let started = (self.ratchet.runtime.coordinator)
            .submit(
                &self.id,
                message.to_owned(),
                self.ratchet.template.clone(),
                Multitask::Enqueue,
            )
            .await
            .map_err(|cause| Error::Runtime {
                what: format!("sending a message to session {}", self.id),
                cause,
            })?;
        Ok(self.ratchet.run(started.run_id))
    }
}

/// A run, followed from this process.
pub struct Run<'a> {
    ratchet: &'a Ratchet,
    id: RunId,
}

/// Where a run stands after [`Run::wait`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// `completed`, `failed` or `cancelled`; or `waiting_human` when a person must answer.
    pub status: RunStatus,
    pub stop_reason: Option<StopReason>,
    /// The run's answer, once it has completed.
    pub answer: Option<String>,
    /// Its committed steps.
    pub steps: u64,
}

/// A batch of tool calls held until a person — or the program — decides, from
/// [`Run::approval`].
#[derive(Debug, Clone, PartialEq)]
pub struct Approval {
    pub id: ApprovalId,
    /// Every call of the batch; those with `needs_approval` false are only held with it.
    pub calls: Vec<ApprovalCall>,
}

/// How often a wait looks at the store when no event has told it anything: a step may be
/// committed by another process sharing the database.
const WAIT_POLL: Duration = Duration::from_millis(250);

impl<'a> Run<'a> {
    pub fn id(&self) -> &RunId {
        &self.id
    }

    async fn state(&self) -> Result<AgentState> {
        read_state(self.ratchet, &self.id).await
    }

    /// Every event of the run in the order it was committed — what it said, the tools it
    /// called, their results, each committed step — from its first, then as they come,
    /// ending after `run.finished`. Another process may be running the run's steps: the store
    /// is read again whenever the bus has been quiet a while.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> ratchet::Result<()> {
    /// use futures::StreamExt;
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let url = format!("sqlite://{}", dir.path().join("agents.db").display());
    /// let ratchet = ratchet::Ratchet::builder().database(&url).workspace(dir.path()).build().await?;
    /// let run = ratchet.session().await?.send("What is 2 + 3?").await?;
    /// let mut events = Box::pin(run.events());
    /// while let Some(event) = events.next().await {
    ///     let event = event?;
    ///     println!("{} {}", event.seq, event.kind); // run.created … step.committed … run.finished
    /// }
    /// # drop(events);
    /// # drop(run);
    /// # ratchet.shutdown().await;
    /// # Ok(())
    /// # }
    /// ```
    pub fn events(&self) -> impl Stream<Item = Result<StoredEvent>> + Send + 'a {
        struct Follow<'a> {
            ratchet: &'a Ratchet,
            run: RunId,
            session: Option<SessionId>,
            after: i64,
            page: std::vec::IntoIter<StoredEvent>,
            bus: broadcast::Receiver<StoredEvent>,
            ended: bool,
        }
        let follow = Follow {
            ratchet: self.ratchet,
            run: self.id.clone(),
            session: None,
            after: 0,
            page: Vec::new().into_iter(),
            bus: self.ratchet.runtime.coordinator.subscribe(),
            ended: false,
        };
        futures::stream::unfold(follow, |mut follow| async move {
            loop {
                if let Some(event) = follow.page.next() {
                    follow.after = event.seq;
                    if event.run_id.as_ref() != Some(&follow.run) {
                        continue;
                    }
                    follow.ended = event.kind == "run.finished";
                    return Some((Ok(event), follow));
                }
                if follow.ended {
                    return None;
                }
                let store = follow.ratchet.store();
                let session = match &follow.session {
                    Some(session) => session.clone(),
                    None => match read_state(follow.ratchet, &follow.run).await {
                        Ok(state) => {
                            follow.session = Some(state.session_id.clone());
                            state.session_id
                        }
                        Err(error) => {
                            follow.ended = true;
                            return Some((Err(error), follow));
                        }
                    },
                };
                match store.events_after(&session, follow.after, 200).await {
                    Ok(page) if !page.is_empty() => follow.page = page.into_iter(),
                    Ok(_) => {
                        let _ = tokio::time::timeout(WAIT_POLL, follow.bus.recv()).await;
                    }
                    Err(cause) => {
                        follow.ended = true;
                        let what = format!("reading the events of run {}", follow.run);
                        return Some((Err(Error::Store { what, cause }), follow));
                    }
                }
            }
        })
    }

    /// The batch the run waits on a decision for, if it waits for one.
    pub async fn approval(&self) -> Result<Option<Approval>> {
        Ok(match self.state().await?.pending_human {
            Some(HumanRequest::Approval { approval_id, calls }) => Some(Approval {
                id: approval_id,
                calls,
            }),
            _ => None,
        })
    }

    /// Decides `approval`: a verdict for each call that needs one (a call denied is not run,
    /// and the model reads why), recorded as decided by `by`. The run goes on at once.
    pub async fn decide(
        &self,
        approval: &Approval,
        decisions: Vec<CallDecision>,
        by: &str,
    ) -> Result<()> {
        (self.ratchet.runtime.coordinator)
            .answer_approval(&approval.id, ApprovalAnswer::Decisions(decisions), by)
            .await
            .map(|_| ())
            .map_err(|cause| Error::Runtime {
                what: format!("deciding approval {}", approval.id),
                cause,
            })
    }

    /// Waits until the run has ended, or waits for a person (an approval, a reconciliation).
    pub async fn wait(&self) -> Result<Outcome> {
        let mut events = self.ratchet.runtime.coordinator.subscribe();
        loop {
            let state = self.state().await?;
            if state.status.is_terminal() || state.status == RunStatus::WaitingHuman {
                return Ok(Outcome {
                    status: state.status,
                    stop_reason: state.stop_reason,
                    answer: state
                        .final_answer
                        .filter(|_| state.status == RunStatus::Completed),
                    steps: state.step_index,
                });
            }
            // Any event of this run may be the one that ended it; a lagging receiver reads
            // the store again, and so does a wait that other runs' events kept busy until the
            // poll came due.
            let due = tokio::time::Instant::now() + WAIT_POLL;
            loop {
                match tokio::time::timeout_at(due, events.recv()).await {
                    Ok(Ok(event)) if event.run_id.as_ref() != Some(&self.id) => continue,
                    Ok(Err(RecvError::Closed)) => tokio::time::sleep_until(due).await,
                    _ => {}
                }
                break;
            }
        }
    }
}
