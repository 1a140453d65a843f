//! Assembles a runtime from a database URL: store, models, tools, coordinator and engine.
//! Database urls become stores here and nowhere else (`open_store`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ratchet_core::{
    ApprovalPolicy, Limits, MemoryScope, ReplayPolicy, RunConfigSnapshot, ToolSpec,
};
use ratchet_engine::{
    Coordinator, Engine, Models, PermitLimits, PoolConfig, WorkerPool, owner_is_dead_local_process,
};
use ratchet_llm::profiles::{Profile, Resolved};
use ratchet_mcp::{McpTools, ToolsWatch};
use ratchet_postgres::PgOptions;
use ratchet_sqlite::SqliteOptions;
use ratchet_store::{Deliveries, Keyring, Migrated, Roles, RunQuota, Store, WebhookAdmin};
use ratchet_tools::{Registry, Tool};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::{Error, Result};

/// The tools and models a process offers; needs no store, so input can be checked first.
pub struct Toolbox {
    pub tools: Arc<Registry>,
    pub models: Arc<Models>,
    profiles: BTreeMap<String, Profile>,
    /// The MCP servers' connections, closed when the runtime shuts down.
    mcp: Option<McpTools>,
    /// Counts the times the tools were replaced (an MCP server's tools changed).
    changes: watch::Receiver<u64>,
}

const SYSTEM_PROMPT: &str = "You are a helpful assistant. Use the tools when they help.";

impl Toolbox {
    /// Checks a model spec, workspace, budget and approval policies (by tool name) and
    /// freezes them, with the history `memory_search` looks through, into the configuration
    /// new runs start with. A scripted model's file is read and checked now; a provider's
    /// model is frozen with its settings (never its key) and its profile's retries.
    pub fn run_template(
        &self,
        model: &str,
        workspace: Option<&Path>,
        limits: Limits,
        overrides: &ToolOverrides,
        memory_scope: MemoryScope,
    ) -> Result<RunConfigSnapshot> {
        let zero = [
            (limits.max_steps == 0).then_some("--max-steps"),
            (limits.max_model_calls == Some(0)).then_some("--max-model-calls"),
            (limits.max_tokens == Some(0)).then_some("--max-tokens"),
            (limits.max_prompt_tokens == Some(0)).then_some("--max-prompt-tokens"),
        ];
        if let Some(flag) = zero.into_iter().flatten().next() {
            return Err(Error::Invalid(format!("{flag} must be at least 1")));
        }
        let workspace = match workspace {
            Some(dir) => dir.to_path_buf(),
            None => std::env::current_dir()
                .map_err(|e| Error::Invalid(format!("cannot read the current directory: {e}")))?,
        };
        let workspace = workspace.canonicalize().map_err(|e| {
            Error::Invalid(format!(
                "workspace {} is not an existing directory: {e}",
                workspace.display()
            ))
        })?;
        if !workspace.is_dir() {
            return Err(Error::Invalid(format!(
                "workspace {} is not a directory",
                workspace.display()
            )));
        }
        let model = match model.strip_prefix("scripted:") {
            Some(path) if path != "demo" => {
                let absolute = std::path::absolute(path)
                    .map_err(|e| Error::Invalid(format!("bad script path {path:?}: {e}")))?;
                format!("scripted:{}", absolute.display())
            }
            _ => model.to_owned(),
        };
        let resolved = self.resolve_model(&model)?;
        let mut limits = limits;
        if let Some(attempts) = resolved.max_attempts {
            limits.max_model_attempts = attempts;
        }
        let mut tools = self.tools.specs();
        for (name, policy) in &overrides.approval {
            policy
                .validate()
                .map_err(|e| Error::Invalid(format!("tool {name:?}: {e}")))?;
            let spec = find_tool(&mut tools, name, "approval policy", &self.tools)?;
            spec.approval = policy.clone();
        }
        for (name, replay) in &overrides.replay {
            find_tool(&mut tools, name, "replay policy", &self.tools)?.replay = *replay;
        }
        for (name, limits) in &overrides.calls {
            limits.apply(&mut find_tool(&mut tools, name, "call limits", &self.tools)?.calls);
        }
        Ok(RunConfigSnapshot {
            model,
            model_settings: resolved.settings,
            workspace: Some(workspace.display().to_string()),
            system_prompt: SYSTEM_PROMPT.to_owned(),
            tools,
            limits,
            memory_scope,
            ..RunConfigSnapshot::default()
        })
    }

    /// Checks a model spec (a scripted model's file as given) as a run would be frozen with
    /// it: a provider's settings resolved, any other model built, its script read and checked.
    pub fn resolve_model(&self, model: &str) -> Result<Resolved> {
        if self.models.is_registered(model) {
            return Ok(Resolved {
                settings: None,
                max_attempts: None,
            });
        }
        let env = |name: &str| std::env::var(name).ok();
        let resolved = ratchet_llm::profiles::resolve_spec(model, &self.profiles, &env)?;
        if resolved.settings.is_none() {
            self.models.resolve(model)?;
        }
        Ok(resolved)
    }

    pub fn new() -> Toolbox {
        Toolbox::of(Registry::builtin(), None)
    }

    pub(crate) fn of(registry: Registry, mcp: Option<McpTools>) -> Toolbox {
        let tools = Arc::new(registry);
        let models = Arc::new(Models::new(tools.names()));
        Toolbox {
            tools,
            models,
            profiles: BTreeMap::new(),
            mcp,
            changes: watch::channel(0).1,
        }
    }

    /// The built-in tools (`memory_search` showing at most `max_snippet_bytes` of a message)
    /// and those of the configured MCP servers (`SERVER.TOOL`), all started or reached now:
    /// a server that cannot start is an error naming it.
    pub async fn with_mcp(
        config: &ratchet_mcp::Config,
        max_snippet_bytes: usize,
    ) -> Result<Toolbox> {
        let builtin = Registry::builtin_tools(max_snippet_bytes);
        if config.servers.is_empty() {
            return Ok(Toolbox::of(Registry::new(builtin)?, None));
        }
        let mcp = ratchet_mcp::connect_all(config).await?;
        let registry = Registry::new([builtin.clone(), mcp.tools()].concat())?;
        let watch = mcp.watch();
        let mut toolbox = Toolbox::of(registry, Some(mcp));
        let (changed, changes) = watch::channel(0);
        tokio::spawn(follow_mcp(
            Arc::clone(&toolbox.tools),
            builtin,
            watch,
            changed,
        ));
        toolbox.changes = changes;
        Ok(toolbox)
    }

    /// Changes each time the tools are replaced because an MCP server's tools changed: the
    /// runs created from then on are to be frozen with the new ones.
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.changes.clone()
    }

    /// The same tools, models and profiles without the MCP connections, which stay with this
    /// one: what a reload checks a new catalog against while the runtime owns the
    /// connections.
    pub fn detached(&self) -> Toolbox {
        Toolbox {
            tools: Arc::clone(&self.tools),
            models: Arc::clone(&self.models),
            profiles: self.profiles.clone(),
            mcp: None,
            changes: self.changes.clone(),
        }
    }

    /// Ends the MCP servers' connections, for a process that only checks its input.
    pub async fn close(&self) {
        if let Some(mcp) = &self.mcp {
            mcp.close().await;
        }
    }

    /// The `[models.NAME]` profiles a model spec may name; each is checked now.
    pub fn with_profiles(mut self, profiles: BTreeMap<String, Profile>) -> Result<Toolbox> {
        let env = |name: &str| std::env::var(name).ok();
        ratchet_llm::profiles::check_profiles(&profiles, &env)?;
        self.profiles = profiles;
        Ok(self)
    }
}

impl Default for Toolbox {
    fn default() -> Toolbox {
        Toolbox::new()
    }
}

/// A catalog's definitions are checked against the tools and models this toolbox offers.
impl ratchet_catalog::Known for Toolbox {
    fn tool(&self, name: &str) -> std::result::Result<(), String> {
        let names = self.tools.names();
        if names.iter().any(|known| known == name) {
            Ok(())
        } else {
            Err(format!("the runtime's tools are {}", names.join(", ")))
        }
    }

    fn model(&self, spec: &str) -> std::result::Result<(), String> {
        self.resolve_model(spec)
            .map(|_| ())
            .map_err(|error| error.to_string())
    }
}

/// Keeps the registry in step with the MCP servers' tools until the connections are gone.
async fn follow_mcp(
    registry: Arc<Registry>,
    builtin: Vec<Arc<dyn Tool>>,
    mut watch: ToolsWatch,
    changed: watch::Sender<u64>,
) {
    while let Some(mcp) = watch.changed().await {
        match registry.replace([builtin.clone(), mcp].concat()) {
            Ok(()) => changed.send_modify(|count| *count += 1),
            Err(error) => {
                tracing::warn!(%error, "an MCP server's new tools cannot be offered: the previous ones stay");
            }
        }
    }
}

/// Policies the configuration sets for tools, by tool name, over the tools' own.
#[derive(Debug, Clone, Default)]
pub struct ToolOverrides {
    pub approval: BTreeMap<String, ApprovalPolicy>,
    pub replay: BTreeMap<String, ReplayPolicy>,
    pub calls: BTreeMap<String, crate::CallLimitsOverride>,
}

fn find_tool<'a>(
    tools: &'a mut [ToolSpec],
    name: &str,
    what: &str,
    registry: &Registry,
) -> Result<&'a mut ToolSpec> {
    let known = registry.names().join(", ");
    tools.iter_mut().find(|t| t.name == name).ok_or_else(|| {
        Error::Invalid(format!(
            "{what} for unknown tool {name:?}; the tools are: {known}"
        ))
    })
}

pub struct Runtime {
    /// The only writer; it hands out the store's `Reads`.
    pub coordinator: Arc<Coordinator>,
    /// The store's webhook administration, for the HTTP API.
    pub webhooks: Arc<dyn WebhookAdmin>,
    /// The store's delivery log, for the webhook dispatcher.
    pub deliveries: Arc<dyn Deliveries>,
    engine: Arc<Engine>,
    mcp: Option<McpTools>,
    /// Relays what other processes commit (when the store can hear it).
    follower: Option<JoinHandle<()>>,
}

/// Whether opening a database may change its schema.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Schema {
    /// Apply the migrations the database lacks, creating it if needed.
    Migrate,
    /// Refuse a database that does not exist or whose schema is behind this build
    /// (`--no-migrate`): only `ratchet migrate` changes it.
    Require,
}

/// A database url, by backend: the one place a url scheme is recognised. A new backend adds
/// a variant here, and the matches below (open, migrate) say what it must provide.
enum Database {
    Sqlite(SqliteOptions),
    Postgres(Box<PgOptions>),
}

impl Database {
    fn parse(url: &str) -> Result<Database> {
        let invalid = |e: ratchet_store::Error| Error::Invalid(e.to_string());
        if url.starts_with("sqlite:") {
            return Ok(Database::Sqlite(
                SqliteOptions::from_url(url).map_err(invalid)?,
            ));
        }
        if url.starts_with("postgres:") || url.starts_with("postgresql:") {
            return Ok(Database::Postgres(Box::new(
                PgOptions::from_url(url).map_err(invalid)?,
            )));
        }
        Err(Error::Invalid(format!(
            "unsupported database url {url:?}: expected sqlite://PATH or postgres://USER@HOST:PORT/DATABASE"
        )))
    }
}

/// Whether the processes sharing the database the url names hear of each other's changes
/// (PostgreSQL notifies; SQLite has no notifications, so its processes only poll).
pub fn announces_changes(url: &str) -> Result<bool> {
    Ok(match Database::parse(url)? {
        Database::Sqlite(_) => false,
        Database::Postgres(_) => true,
    })
}

/// The directory a SQLite database's file is in, whose disk its commits wait on; `None` for a
/// database on a server.
pub fn database_directory(url: &str) -> Result<Option<PathBuf>> {
    Ok(match Database::parse(url)? {
        Database::Sqlite(options) => Some(match options.path.parent() {
            Some(parent) if !parent.as_os_str().is_empty() => parent.to_path_buf(),
            _ => PathBuf::from("."),
        }),
        Database::Postgres(_) => None,
    })
}

/// The bytes the database a url names takes now: SQLite's pages (those in the WAL included),
/// PostgreSQL's `pg_database_size`.
pub fn database_bytes(url: &str) -> Result<u64> {
    let bytes = match Database::parse(url)? {
        Database::Sqlite(options) => ratchet_sqlite::database_bytes(&options.path),
        Database::Postgres(options) => ratchet_postgres::database_bytes(&options),
    };
    bytes.map_err(|cause| Error::Store {
        what: format!("cannot measure the size of database {url}"),
        cause,
    })
}

/// Where a database without a configured secrets key keeps the key made for it: beside a
/// SQLite file (`<file>.key`). None for a database on a server, whose processes may not share
/// a disk.
pub fn own_key_file(url: &str) -> Result<Option<PathBuf>> {
    Ok(match Database::parse(url)? {
        Database::Sqlite(options) => {
            let mut path = options.path.into_os_string();
            path.push(".key");
            Some(PathBuf::from(path))
        }
        Database::Postgres(_) => None,
    })
}

/// Opens the store a database url names. It cannot create webhooks or send to them: those
/// need `open_sealed_store`.
pub fn open_store(url: &str, schema: Schema) -> Result<Arc<dyn Store>> {
    open(url, schema, None)
}

/// Opens the store a database url names, sealing and opening webhook secrets with `keyring`.
pub fn open_sealed_store(url: &str, schema: Schema, keyring: Keyring) -> Result<Arc<dyn Store>> {
    open(url, schema, Some(keyring))
}

fn open(url: &str, schema: Schema, keyring: Option<Keyring>) -> Result<Arc<dyn Store>> {
    let opened: ratchet_store::Result<Arc<dyn Store>> = match Database::parse(url)? {
        Database::Sqlite(options) => {
            let options = SqliteOptions {
                migrate: schema == Schema::Migrate,
                ..options
            };
            ratchet_sqlite::open(options).map(|store| match keyring {
                Some(keyring) => Arc::new(store.with_secrets(keyring)) as Arc<dyn Store>,
                None => Arc::new(store),
            })
        }
        Database::Postgres(options) => {
            let options = PgOptions {
                migrate: schema == Schema::Migrate,
                ..*options
            };
            ratchet_postgres::open(options).map(|store| match keyring {
                Some(keyring) => Arc::new(store.with_secrets(keyring)) as Arc<dyn Store>,
                None => Arc::new(store),
            })
        }
    };
    opened.map_err(|cause| Error::Store {
        what: match schema {
            Schema::Migrate => format!("cannot open database {url}"),
            Schema::Require => format!(
                "cannot open database {url} without migrating it (--no-migrate); apply the \
                 migrations first with `ratchet migrate --db {url}`"
            ),
        },
        cause,
    })
}

/// Opens a database that must already exist: reading commands never create one.
pub fn open_existing_store(url: &str) -> Result<Arc<dyn Store>> {
    match Database::parse(url)? {
        Database::Sqlite(options) => {
            if !options.path.is_file() {
                return Err(Error::Invalid(format!(
                    "database {} does not exist",
                    options.path.display()
                )));
            }
        }
        // A server's database is never created by opening it: a missing one fails to connect.
        Database::Postgres(_) => {}
    }
    open_store(url, Schema::Migrate)
}

/// Applies the migrations the database lacks (creating it if needed), and nothing else.
pub fn migrate(url: &str) -> Result<Migrated> {
    let migrated = match Database::parse(url)? {
        Database::Sqlite(options) => ratchet_sqlite::migrate(&options),
        Database::Postgres(options) => ratchet_postgres::migrate(&options),
    };
    migrated.map_err(|cause| Error::Store {
        what: format!("cannot migrate database {url}"),
        cause,
    })
}

impl Runtime {
    /// Must be called inside a tokio runtime: it starts following other processes.
    pub fn new(store: impl Into<Roles>, toolbox: Toolbox) -> Runtime {
        Runtime::gated(store, toolbox, RunQuota::default(), PermitLimits::default())
    }

    /// A runtime that admits runs within `quota` and makes calls within `permits`.
    pub fn gated(
        store: impl Into<Roles>,
        toolbox: Toolbox,
        quota: RunQuota,
        permits: PermitLimits,
    ) -> Runtime {
        let roles = store.into();
        let (webhooks, deliveries) = (Arc::clone(&roles.webhooks), Arc::clone(&roles.deliveries));
        let coordinator = Coordinator::with_quota(roles, quota);
        let follower = coordinator.follow_others();
        coordinator.follow_database_clock();
        let engine = Arc::new(
            Engine::new(Arc::clone(&coordinator), toolbox.models, toolbox.tools)
                .with_permits(permits)
                .with_capture(ratchet_telemetry::Capture::from_env()),
        );
        Runtime {
            coordinator,
            webhooks,
            deliveries,
            engine,
            mcp: toolbox.mcp,
            follower,
        }
    }

    /// Ends the MCP servers' connections (stdio servers are stopped). After the workers.
    pub async fn close_tools(&self) {
        if let Some(mcp) = &self.mcp {
            mcp.close().await;
        }
    }

    /// Releases the leases of dead processes on this machine, so their steps are taken over
    /// now rather than when the leases expire (which is how other machines' are).
    pub async fn recover(&self) -> Result<u64> {
        self.coordinator
            .recover(owner_is_dead_local_process)
            .await
            .map_err(|cause| Error::Runtime {
                what: "recovering the steps of dead processes".to_owned(),
                cause,
            })
    }

    /// Takes over the steps of dead processes, then starts the workers (on the database's
    /// clock where it has one).
    pub async fn recover_and_start(&self, config: PoolConfig) -> Result<WorkerPool> {
        self.recover().await?;
        // The first lease is stamped by the database's clock where it has one.
        self.coordinator
            .sync_clock()
            .await
            .map_err(|cause| Error::Runtime {
                what: "reading the database's clock".to_owned(),
                cause,
            })?;
        Ok(self.start_workers(config))
    }

    pub fn start_workers(&self, config: PoolConfig) -> WorkerPool {
        WorkerPool::start(
            Arc::clone(&self.coordinator),
            Arc::clone(&self.engine),
            config,
        )
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        if let Some(follower) = &self.follower {
            follower.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn overrides_set_a_tools_policies_and_unknown_tools_are_refused() {
        let toolbox = Toolbox::new();
        let dir = tempfile::tempdir().unwrap();
        let mut overrides = ToolOverrides::default();
        overrides
            .approval
            .insert("append_line".into(), ApprovalPolicy::Always);
        overrides
            .replay
            .insert("append_line".into(), ReplayPolicy::Keyed);
        let template = toolbox
            .run_template(
                "scripted:demo",
                Some(dir.path()),
                Limits::default(),
                &overrides,
                MemoryScope::Session,
            )
            .unwrap();
        let append = template.tool("append_line").unwrap();
        assert_eq!(
            (&append.approval, append.replay),
            (&ApprovalPolicy::Always, ReplayPolicy::Keyed)
        );
        assert_eq!(
            template.tool("add").unwrap().approval,
            ApprovalPolicy::Never,
            "others keep their own"
        );
        overrides.replay.insert("rm_rf".into(), ReplayPolicy::Safe);
        let error = toolbox
            .run_template(
                "scripted:demo",
                Some(dir.path()),
                Limits::default(),
                &overrides,
                MemoryScope::Session,
            )
            .unwrap_err();
        assert!(
            error
                .to_string()
                .contains("replay policy for unknown tool \"rm_rf\""),
            "{error}"
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]

        /// A url is the backend its scheme names, read by that backend's own parser, or it
        /// is refused with a reason.
        #[test]
        fn a_database_url_is_read_by_the_backend_its_scheme_names(
            url in prop_oneof![
                any::<String>(),
                ("(sqlite|postgres|postgresql|mysql|)(:|://)", any::<String>())
                    .prop_map(|(scheme, rest)| format!("{scheme}{rest}")),
            ],
        ) {
            let parsed = Database::parse(&url);
            if url.starts_with("sqlite:") {
                prop_assert_eq!(parsed.is_ok(), SqliteOptions::from_url(&url).is_ok());
                prop_assert!(matches!(parsed, Ok(Database::Sqlite(_)) | Err(_)));
            } else if url.starts_with("postgres:") || url.starts_with("postgresql:") {
                prop_assert_eq!(parsed.is_ok(), PgOptions::from_url(&url).is_ok());
                prop_assert!(matches!(parsed, Ok(Database::Postgres(_)) | Err(_)));
            } else {
                let error = parsed.err().unwrap().to_string();
                prop_assert!(error.starts_with("unsupported database url"), "{}", error);
            }
            if let Err(error) = Database::parse(&url) {
                let message = format!("{error:#}");
                prop_assert!(!message.trim().is_empty());
            }
        }

        /// Whatever `--model` says, the template is frozen with a model it can run, or the
        /// spec is refused with a reason.
        #[test]
        fn any_model_spec_is_frozen_or_refused_with_a_reason(
            spec in prop_oneof![
                any::<String>(),
                ("(scripted|openai|anthropic|x|):", any::<String>())
                    .prop_map(|(kind, rest)| format!("{kind}{rest}")),
                Just("scripted:demo".to_owned()),
            ],
        ) {
            let toolbox = Toolbox::new();
            let dir = tempfile::tempdir().unwrap();
            let template = toolbox.run_template(
                &spec,
                Some(dir.path()),
                Limits::default(),
                &ToolOverrides::default(),
                MemoryScope::Session,
            );
            match template {
                Ok(template) => match template.model_settings {
                    Some(settings) => prop_assert!(
                        spec == format!("{}:{}", settings.provider, settings.model),
                        "{} froze {:?}", spec, settings
                    ),
                    None => prop_assert!(toolbox.models.resolve(&template.model).is_ok()),
                },
                Err(error) => {
                    let message = format!("{error:#}");
                    prop_assert!(!message.trim().is_empty());
                }
            }
        }
    }
}
