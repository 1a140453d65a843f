//! Sub-agents end to end on real SQLite files: foreground delegations of 1, 3 and 64 tasks,
//! three levels of nesting under one model-call permit, a parent's cancel reaching its
//! children, and `agent_task` confined to the runs below its caller.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use ratchet_core::delegation::{agent_task_tool, delegate_tool};
use ratchet_core::{
    AgentProfile, DelegationConfig, Message, ModelReply, Role, RunConfigSnapshot, RunId, RunStatus,
    StopReason, ToolCall, TreeBudget, Usage,
};
use ratchet_engine::{
    Coordinator, Engine, Models, Multitask, PermitLimits, PoolConfig, WorkerPool,
};
use ratchet_llm::{Model, ModelRequest};
use ratchet_store::{RunQuota, SessionSpec, Store};
use ratchet_tools::Registry;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// What a test's model answers, given the request.
type Policy = dyn Fn(&ModelRequest) -> ModelReply + Send + Sync;

/// A model whose answers a test writes as a function of the conversation; it counts how many
/// of its calls are in flight at once, and holds each call for `hold`.
struct PolicyModel {
    policy: Box<Policy>,
    hold: Duration,
    in_flight: AtomicUsize,
    most_in_flight: AtomicUsize,
}

impl PolicyModel {
    fn new(
        hold: Duration,
        policy: impl Fn(&ModelRequest) -> ModelReply + Send + Sync + 'static,
    ) -> Arc<PolicyModel> {
        Arc::new(PolicyModel {
            policy: Box::new(policy),
            hold,
            in_flight: AtomicUsize::new(0),
            most_in_flight: AtomicUsize::new(0),
        })
    }
}

#[async_trait]
impl Model for PolicyModel {
    async fn complete(
        &self,
        request: ModelRequest,
        _deltas: mpsc::UnboundedSender<String>,
        cancel: CancellationToken,
    ) -> ratchet_llm::Result<ModelReply> {
        let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.most_in_flight.fetch_max(now, Ordering::SeqCst);
        let held = tokio::select! {
            () = tokio::time::sleep(self.hold) => Ok((self.policy)(&request)),
            () = cancel.cancelled() => Err(ratchet_llm::Error::Cancelled),
        };
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
        held
    }
}

struct Node {
    coordinator: Arc<Coordinator>,
    _pool: WorkerPool,
    _dir: tempfile::TempDir,
}

/// One process: the policy model runs whose spec is `test:policy` (and, when given,
/// `test:quick`) talk to, a worker pool, and a fresh database.
fn node(model: Arc<PolicyModel>, quick: Option<Arc<PolicyModel>>, permits: PermitLimits) -> Node {
    node_within(model, quick, permits, RunQuota::default())
}

/// `node`, its Coordinator admitting runs within `quota`.
fn node_within(
    model: Arc<PolicyModel>,
    quick: Option<Arc<PolicyModel>>,
    permits: PermitLimits,
    quota: RunQuota,
) -> Node {
    let dir = tempfile::tempdir().unwrap();
    let store: Arc<dyn Store> = Arc::new(ratchet_store_memory::MemoryStore::new());
    let tools = Arc::new(Registry::builtin());
    let models = Arc::new(Models::new(tools.names()));
    models.register("test:policy", model);
    if let Some(quick) = quick {
        models.register("test:quick", quick);
    }
    let coordinator = Coordinator::with_quota(store, quota);
    let engine =
        Arc::new(Engine::new(Arc::clone(&coordinator), models, tools).with_permits(permits));
    let pool = WorkerPool::start(
        Arc::clone(&coordinator),
        engine,
        PoolConfig {
            workers: 6,
            poll: Duration::from_millis(10),
            ..PoolConfig::default()
        },
    );
    Node {
        coordinator,
        _pool: pool,
        _dir: dir,
    }
}

/// An agent's configuration: the policy model, and — when it has delegates — the `delegate`
/// and `agent_task` tools over them.
fn agent(id: &str, delegates: Vec<AgentProfile>) -> AgentProfile {
    let mut config = RunConfigSnapshot {
        model: "test:policy".into(),
        system_prompt: format!("you are {id}"),
        ..RunConfigSnapshot::default()
    };
    if !delegates.is_empty() {
        config.tools = vec![delegate_tool(&delegates), agent_task_tool()];
        config.delegation = DelegationConfig {
            agents: delegates,
            ..DelegationConfig::default()
        };
    }
    AgentProfile {
        id: id.into(),
        description: format!("the {id}"),
        config,
    }
}

fn call(name: &str, arguments: Value) -> ModelReply {
    ModelReply {
        tool_calls: vec![ToolCall {
            id: format!("call-{name}"),
            name: name.into(),
            arguments,
        }],
        ..ModelReply::default()
    }
}

fn text(answer: String) -> ModelReply {
    ModelReply {
        text: answer,
        ..ModelReply::default()
    }
}

fn first_user_message(request: &ModelRequest) -> &str {
    request
        .messages
        .iter()
        .find(|m| m.role == Role::User)
        .map_or("", |m| m.content.as_str())
}

fn tool_results(messages: &[Message]) -> Vec<&str> {
    messages
        .iter()
        .filter(|m| m.role == Role::Tool)
        .map(|m| m.content.as_str())
        .collect()
}

fn offers(request: &ModelRequest, tool: &str) -> bool {
    request.tools.iter().any(|t| t.name == tool)
}

/// The common policy: a run offered `delegate` hands `fan_out` tasks (named after its own
/// task) to `to`, then answers with the joined results; any other run answers its task.
fn fan_out_policy(
    fan_out: usize,
    to: &'static str,
) -> impl Fn(&ModelRequest) -> ModelReply + Send + Sync {
    move |request| {
        let task = first_user_message(request).to_owned();
        let results = tool_results(&request.messages);
        if offers(request, "delegate") && results.is_empty() {
            let tasks: Vec<Value> = (0..fan_out)
                .map(|i| json!({"agent": to, "task": format!("{task}/{i}")}))
                .collect();
            return call("delegate", json!({"mode": "foreground", "tasks": tasks}));
        }
        match results.first() {
            Some(joined) => text(format!("joined {joined}")),
            None => text(format!("did {task}")),
        }
    }
}

async fn start(coordinator: &Coordinator, task: &str, config: RunConfigSnapshot) -> RunId {
    let session = coordinator
        .create_session(SessionSpec::default())
        .await
        .unwrap()
        .id;
    coordinator
        .submit(&session, task.into(), config, Multitask::Enqueue)
        .await
        .unwrap()
        .run_id
}

async fn wait_for(
    coordinator: &Coordinator,
    run: &RunId,
    done: impl Fn(RunStatus) -> bool,
) -> ratchet_core::AgentState {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let state = coordinator.store().load_state(run).await.unwrap();
        if done(state.status) {
            return state;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "run {run} stuck in {}",
            state.status
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn answers_of(joined: &Value) -> Vec<String> {
    joined["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["answer"].as_str().unwrap_or("-").to_owned())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delegations_of_one_three_and_sixty_four_tasks_hand_back_every_result_in_order() {
    for tasks in [1, 3, 64] {
        let model = PolicyModel::new(Duration::from_millis(1), fan_out_policy(tasks, "worker"));
        let node = node(Arc::clone(&model), None, PermitLimits::default());
        let boss = agent("boss", vec![agent("worker", Vec::new())]);
        let root = start(&node.coordinator, "job", boss.config).await;
        let state = wait_for(&node.coordinator, &root, RunStatus::is_terminal).await;
        assert_eq!(
            state.status,
            RunStatus::Completed,
            "{tasks} tasks: {state:?}"
        );
        let joined: Value = serde_json::from_str(
            state
                .final_answer
                .as_deref()
                .unwrap()
                .strip_prefix("joined ")
                .unwrap(),
        )
        .unwrap();
        let expected: Vec<String> = (0..tasks).map(|i| format!("did job/{i}")).collect();
        assert_eq!(
            answers_of(&joined),
            expected,
            "{tasks} tasks: one result per task, in order"
        );
        let tree = node.coordinator.store().run_tree(&root).await.unwrap();
        assert_eq!(tree.len(), tasks + 1);
        assert!(
            tree.iter().all(|n| n.status == RunStatus::Completed),
            "{tree:?}"
        );
        let started = node
            .coordinator
            .store()
            .run_events_after(&root, 0, 10_000)
            .await
            .unwrap()
            .into_iter()
            .filter(|e| e.kind == "subagent.started")
            .count();
        assert_eq!(started, tasks);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_levels_of_delegation_complete_with_one_model_call_permit() {
    async fn tree_of(node: &Node) -> (ratchet_core::AgentState, Vec<ratchet_store::TreeNode>) {
        let leaf = agent("leaf", Vec::new());
        let mid = agent("mid", vec![leaf]);
        let top = agent("top", vec![mid]);
        let root = start(&node.coordinator, "job", top.config).await;
        let state = wait_for(&node.coordinator, &root, RunStatus::is_terminal).await;
        let tree = node.coordinator.store().run_tree(&root).await.unwrap();
        (state, tree)
    }
    let policy = || {
        move |request: &ModelRequest| {
            let to = if offers(request, "delegate") && request.system_prompt == "you are top" {
                "mid"
            } else {
                "leaf"
            };
            fan_out_policy(2, to)(request)
        }
    };

    let one_permit = PermitLimits {
        model_calls: Some(1),
        model_calls_per_session: Some(1),
        ..PermitLimits::default()
    };
    let model = PolicyModel::new(Duration::from_millis(30), policy());
    let node = node(Arc::clone(&model), None, one_permit);
    let (state, tree) = tree_of(&node).await;
    assert_eq!(state.status, RunStatus::Completed, "{state:?}");
    assert_eq!(
        tree.iter().map(|n| n.depth).collect::<Vec<_>>(),
        [0, 1, 1, 2, 2, 2, 2],
        "a root, two mids, four leaves"
    );
    assert!(tree.iter().all(|n| n.status == RunStatus::Completed));
    assert_eq!(
        model.most_in_flight.load(Ordering::SeqCst),
        1,
        "one model call at a time"
    );
    assert!(
        state.final_answer.unwrap().contains("did job/0/1"),
        "the leaves' answers reach the root"
    );

    // The same tree without the permit's limit overlaps its calls: the limit above is what
    // kept them one at a time.
    let model = PolicyModel::new(Duration::from_millis(30), policy());
    let node = self::node(Arc::clone(&model), None, PermitLimits::default());
    let (state, _) = tree_of(&node).await;
    assert_eq!(state.status, RunStatus::Completed);
    assert!(model.most_in_flight.load(Ordering::SeqCst) > 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_a_parent_mid_delegation_cancels_its_children() {
    // Workers think for a minute: only a cancel ends them.
    let model = PolicyModel::new(Duration::from_secs(60), fan_out_policy(3, "worker"));
    let quick = PolicyModel::new(Duration::from_millis(1), fan_out_policy(3, "worker"));
    let node = node(Arc::clone(&model), Some(quick), PermitLimits::default());
    // The boss's own calls are quick; its workers' are slow.
    let mut boss = agent("boss", vec![agent("worker", Vec::new())]);
    boss.config.model = "test:quick".into();
    let root = start(&node.coordinator, "job", boss.config).await;
    wait_for(&node.coordinator, &root, |s| {
        s == RunStatus::WaitingChildren
    })
    .await;
    let store = node.coordinator.store();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while store
        .run_tree(&root)
        .await
        .unwrap()
        .iter()
        .filter(|n| n.status == RunStatus::Running)
        .count()
        < 3
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the workers never started"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    node.coordinator.request_cancel(&root).await.unwrap();
    assert_eq!(
        store.load_state(&root).await.unwrap().status,
        RunStatus::Cancelled,
        "a waiting parent is cancelled at once"
    );
    for child in store.run_tree(&root).await.unwrap().iter().skip(1) {
        let state = wait_for(&node.coordinator, &child.run_id, RunStatus::is_terminal).await;
        assert_eq!(state.status, RunStatus::Cancelled, "{}", child.run_id);
    }
    assert_eq!(
        store.load_state(&root).await.unwrap().status,
        RunStatus::Cancelled,
        "no join woke the cancelled parent"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_task_reaches_only_the_runs_below_its_caller() {
    let policy = |request: &ModelRequest| {
        let results = tool_results(&request.messages);
        let task = first_user_message(request).to_owned();
        let agent_task = |action: &str, run: Option<&str>| {
            call("agent_task", json!({"action": action, "run_id": run}))
        };
        let delegate = |agent: &str, task: String| {
            call(
                "delegate",
                json!({"mode": "foreground", "tasks": [{"agent": agent, "task": task}]}),
            )
        };
        match (request.system_prompt.as_str(), results.len()) {
            ("you are top", 0) => delegate("mid", format!("root is {}", request.run_id)),
            ("you are top", 1) => agent_task("get", task.strip_prefix("other tree: ")),
            ("you are mid", 0) => delegate("leaf", "leaf work".into()),
            ("you are mid", 1) => agent_task("list", None),
            ("you are mid", 2) => agent_task("get_result", Some(&leaf_of(results[0]))),
            ("you are mid", 3) => agent_task("get", task.strip_prefix("root is ")),
            ("you are mid", 4) => agent_task("cancel", task.strip_prefix("root is ")),
            ("you are leaf", _) => text("leaf done".into()),
            _ => text(results.join("\n")),
        }
    };
    let model = PolicyModel::new(Duration::from_millis(1), policy);
    let node = node(model, None, PermitLimits::default());
    let store = node.coordinator.store();
    let other = start(&node.coordinator, "alone", agent("leaf", Vec::new()).config).await;
    wait_for(&node.coordinator, &other, RunStatus::is_terminal).await;
    let top = agent("top", vec![agent("mid", vec![agent("leaf", Vec::new())])]);
    let root = start(
        &node.coordinator,
        &format!("other tree: {other}"),
        top.config,
    )
    .await;
    let state = wait_for(&node.coordinator, &root, RunStatus::is_terminal).await;
    assert_eq!(
        state.status,
        RunStatus::Completed,
        "a child could not cancel its root: {state:?}"
    );

    let tree = store.run_tree(&root).await.unwrap();
    let (mid, leaf) = (&tree[1], &tree[2]);
    let mid_history = store.history(&mid.session_id).await.unwrap();
    let mid_results = tool_results(&mid_history);
    let listed: Value = serde_json::from_str(mid_results[1]).unwrap();
    let listed: Vec<&str> = listed["runs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["run_id"].as_str().unwrap())
        .collect();
    assert_eq!(
        listed,
        [leaf.run_id.as_str()],
        "list shows the runs below the caller only"
    );
    let result: Value = serde_json::from_str(mid_results[2]).unwrap();
    assert_eq!(
        (result["status"].as_str(), result["answer"].as_str()),
        (Some("completed"), Some("leaf done"))
    );
    for refused in [mid_results[3], mid_results[4]] {
        assert!(
            refused.contains("is not below this run"),
            "an ancestor is out of reach: {refused}"
        );
    }
    let root_history = store.history(&state.session_id).await.unwrap();
    let root_results = tool_results(&root_history);
    assert!(
        root_results[1].contains("is not below this run"),
        "another tree is out of reach: {}",
        root_results[1]
    );
    assert_eq!(
        store.load_state(&other).await.unwrap().status,
        RunStatus::Completed
    );
}

/// The run id of the first child in a `delegate` result.
fn leaf_of(joined: &str) -> String {
    let joined: Value = serde_json::from_str(joined).unwrap_or_else(|e| panic!("{e}: {joined}"));
    joined["results"][0]["run_id"].as_str().unwrap().to_owned()
}

/// A child's `sleep` ends on its timer only: a message queued in its root session, which would
/// wake the root's own sleep, does not reach it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_childs_sleep_is_not_woken_by_input_to_its_root_session() {
    let model = PolicyModel::new(Duration::from_millis(1), |request| {
        let results = tool_results(&request.messages);
        match (offers(request, "delegate"), results.first()) {
            (true, None) => call(
                "delegate",
                json!({"mode": "foreground", "tasks": [{"agent": "sleeper", "task": "nap"}]}),
            ),
            (true, Some(joined)) => text(format!("joined {joined}")),
            (false, None) => call("sleep", json!({"ms": 700})),
            (false, Some(slept)) => text((*slept).to_owned()),
        }
    });
    let node = node(model, None, PermitLimits::default());
    let mut sleeper = agent("sleeper", Vec::new());
    sleeper.config.tools = Registry::builtin()
        .specs()
        .into_iter()
        .filter(|t| t.name == "sleep")
        .collect();
    let boss = agent("boss", vec![sleeper]);
    let root = start(&node.coordinator, "job", boss.config.clone()).await;
    let session = node
        .coordinator
        .store()
        .load_state(&root)
        .await
        .unwrap()
        .session_id;
    let child = loop {
        let tree = node.coordinator.store().run_tree(&root).await.unwrap();
        if let Some(child) = tree.get(1).filter(|c| c.step_index >= 1) {
            break child.run_id.clone();
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    node.coordinator
        .submit(
            &session,
            "meanwhile".into(),
            boss.config,
            Multitask::Enqueue,
        )
        .await
        .unwrap();
    let ended = wait_for(&node.coordinator, &child, RunStatus::is_terminal).await;
    let slept: Value = serde_json::from_str(ended.final_answer.as_deref().unwrap()).unwrap();
    assert_eq!(slept["woke"], "timer", "{slept}");
    assert!(slept["slept_ms"].as_u64().unwrap() >= 700, "{slept}");
    wait_for(&node.coordinator, &root, RunStatus::is_terminal).await;
}

/// Two trees delegate at once under a global quota with room for only one of them: both
/// delegations pass the engine's early count (each batch also sleeps, so both counts are
/// taken before either commits), and the commit that comes second is refused, writes nothing
/// and is redone — and the redone step tells its model why, with the batch's sleep not run
/// again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_delegations_never_exceed_the_run_quota_and_the_refused_one_is_told() {
    let policy = |request: &ModelRequest| {
        if !offers(request, "delegate") {
            return text(format!("did {}", first_user_message(request)));
        }
        let results = tool_results(&request.messages);
        if results.is_empty() {
            let tasks = json!([{"agent": "helper", "task": "a"}, {"agent": "helper", "task": "b"}]);
            return ModelReply {
                tool_calls: vec![
                    ToolCall {
                        id: "call-delegate".into(),
                        name: "delegate".into(),
                        arguments: json!({"mode": "foreground", "tasks": tasks}),
                    },
                    ToolCall {
                        id: "call-sleep".into(),
                        name: "sleep_ms".into(),
                        arguments: json!({"ms": 400}),
                    },
                ],
                ..ModelReply::default()
            };
        }
        text(format!("heard {}", results.join(" | ")))
    };
    let model = PolicyModel::new(Duration::from_millis(100), policy);
    // The children take long enough that the winner's are still unfinished when the refused
    // step is redone: the quota has not freed up in between.
    let slow = PolicyModel::new(Duration::from_secs(3), policy);
    let quota = RunQuota {
        global: Some(4),
        per_session: None,
    };
    let node = node_within(model, Some(slow), PermitLimits::default(), quota);
    let mut helper = agent("helper", Vec::new());
    helper.config.model = "test:quick".into();
    let mut boss = agent("boss", vec![helper]);
    let sleep = Registry::builtin()
        .specs()
        .into_iter()
        .find(|t| t.name == "sleep_ms")
        .unwrap();
    boss.config.tools.push(sleep);
    let (first, second) = tokio::join!(
        start(&node.coordinator, "one", boss.config.clone()),
        start(&node.coordinator, "two", boss.config.clone()),
    );
    let mut trees = Vec::new();
    for root in [&first, &second] {
        let state = wait_for(&node.coordinator, root, RunStatus::is_terminal).await;
        assert_eq!(state.status, RunStatus::Completed, "{state:?}");
        let size = node.coordinator.store().run_tree(root).await.unwrap().len();
        trees.push((size, state));
    }
    trees.sort_by_key(|(size, _)| *size);
    let sizes: Vec<usize> = trees.iter().map(|(size, _)| *size).collect();
    assert_eq!(
        sizes,
        [1, 3],
        "one tree got its two children, the other none"
    );
    let loser = &trees[0].1;
    let answer = loser.final_answer.clone().unwrap_or_default();
    assert!(
        answer.contains("may have at most 4 unfinished runs") && answer.contains("slept 400 ms"),
        "the refused delegation's model read why, beside the sleep's outcome: {answer}"
    );
    let store = node.coordinator.store();
    let released: Vec<String> = store
        .events_after(&loser.session_id, 0, 10_000)
        .await
        .unwrap()
        .into_iter()
        .filter(|e| e.payload["activity"] == "step_released")
        .map(|e| e.payload["error"].as_str().unwrap_or_default().to_owned())
        .collect();
    assert!(
        released
            .iter()
            .any(|error| error.contains("at most 4 may be; 2 more do not fit")),
        "the commit, not the early count, refused the delegation: {released:?}"
    );
    // The sleep is replay-safe: the redone step ran it again, and only the commit that held
    // kept its `tool.call` — the refused one kept nothing.
    let sleeps = store
        .events_after(&loser.session_id, 0, 10_000)
        .await
        .unwrap()
        .into_iter()
        .filter(|e| e.kind == "tool.call" && e.payload["tool"] == "sleep_ms")
        .count();
    assert_eq!(sleeps, 1, "one stored call of the sleep");
}

/// A tree's runs share `[delegation] max_tree_tokens`: the children's spending counts against
/// their parent, whose next model call is made without tools and must conclude, exactly as
/// when a run's own budget has room for one last call. The same tree without the budget
/// delegates a second time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn children_that_spend_the_trees_budget_make_their_parents_next_call_conclude() {
    async fn run_tree(budget: TreeBudget) -> (ratchet_core::AgentState, usize, Arc<PolicyModel>) {
        let policy = |request: &ModelRequest| {
            let spent = Usage {
                input_tokens: 400,
                output_tokens: 100,
                reasoning_tokens: 0,
                cache_write_tokens: 0,
                cache_read_tokens: 0,
            };
            let mut reply = if request.system_prompt == "you are helper" {
                text(format!("did {}", first_user_message(request)))
            } else if !offers(request, "delegate") {
                text("concluded without tools".into())
            } else if tool_results(&request.messages).len() < 2 {
                call(
                    "delegate",
                    json!({"mode": "foreground", "tasks": [{"agent": "helper", "task": "a"}, {"agent": "helper", "task": "b"}]}),
                )
            } else {
                text("delegated twice".into())
            };
            reply.usage = spent;
            reply
        };
        let model = PolicyModel::new(Duration::from_millis(5), policy);
        let node = node(Arc::clone(&model), None, PermitLimits::default());
        let mut boss = agent("boss", vec![agent("helper", Vec::new())]);
        boss.config.delegation.tree_budget = budget;
        let root = start(&node.coordinator, "job", boss.config).await;
        let state = wait_for(&node.coordinator, &root, RunStatus::is_terminal).await;
        let runs = node
            .coordinator
            .store()
            .run_tree(&root)
            .await
            .unwrap()
            .len();
        (state, runs, model)
    }

    // The parent's first call and its two children spend 1500 tokens; the budget is 1200.
    let budget = TreeBudget {
        max_tokens: Some(1_200),
        max_cost_microusd: None,
    };
    let (state, runs, _) = run_tree(budget).await;
    assert_eq!(runs, 3, "the parent did not delegate again");
    assert_eq!(state.status, RunStatus::Completed, "{state:?}");
    assert_eq!(state.stop_reason, Some(StopReason::Completed));
    assert_eq!(
        state.final_answer.as_deref(),
        Some("concluded without tools")
    );
    assert_eq!(state.counters.model_calls, 2);

    let (state, runs, _) = run_tree(TreeBudget::default()).await;
    assert_eq!(runs, 5, "without a tree budget the parent delegates twice");
    assert_eq!(state.final_answer.as_deref(), Some("delegated twice"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_model_sees_long_results_cut_and_marked_while_the_store_keeps_them_whole() {
    let long_answer = "z".repeat(300);
    let seen: Arc<std::sync::Mutex<Vec<String>>> = Arc::default();
    let model = PolicyModel::new(Duration::from_millis(1), {
        let (seen, long_answer) = (Arc::clone(&seen), long_answer.clone());
        move |request| {
            if request.system_prompt == "you are worker" {
                return text(long_answer.clone());
            }
            let results = tool_results(&request.messages);
            if results.is_empty() {
                let wrong = ToolCall {
                    id: "call-add".into(),
                    name: "add".into(),
                    arguments: json!({"a": "not a number", "b": 1}),
                };
                let delegate = ToolCall {
                    id: "call-delegate".into(),
                    name: "delegate".into(),
                    arguments: json!({"mode": "foreground", "tasks": [{"agent": "worker", "task": "write"}]}),
                };
                return ModelReply {
                    tool_calls: vec![wrong, delegate],
                    ..ModelReply::default()
                };
            }
            let mut seen = seen.lock().unwrap();
            seen.extend(results.into_iter().map(str::to_owned));
            text("done".into())
        }
    });
    let node = node(model, None, PermitLimits::default());
    let mut boss = agent("boss", vec![agent("worker", Vec::new())]);
    boss.config.tools.extend(Registry::builtin().specs());
    boss.config.limits.max_tool_result_bytes = 40;
    let root = start(&node.coordinator, "job", boss.config).await;
    let state = wait_for(&node.coordinator, &root, RunStatus::is_terminal).await;
    assert_eq!(state.status, RunStatus::Completed, "{state:?}");

    let seen = seen.lock().unwrap().clone();
    let [tool_error, joined] = seen.as_slice() else {
        panic!("two results in the model's view: {seen:?}");
    };
    assert!(
        tool_error.contains("[truncated by ratchet: showing the first 40 of"),
        "the failed call's long error is cut and marked: {tool_error}"
    );
    let joined: Value = serde_json::from_str(joined).unwrap_or_else(|e| panic!("{e}: {joined}"));
    let answer = joined["results"][0]["answer"].as_str().unwrap();
    assert!(!answer.contains(&long_answer), "{answer}");
    assert!(
        answer.contains("showing the first 40 of 300 bytes"),
        "the child's answer is cut with its size: {answer}"
    );

    let history = node
        .coordinator
        .store()
        .history(&state.session_id)
        .await
        .unwrap();
    let stored: Vec<&str> = tool_results(&history);
    assert!(
        stored.iter().all(|r| !r.contains("truncated by ratchet")),
        "{stored:?}"
    );
    assert!(
        stored[1].contains(&long_answer),
        "the store keeps the child's answer whole"
    );
    let child = &node.coordinator.store().run_tree(&root).await.unwrap()[1];
    let child = node
        .coordinator
        .store()
        .load_state(&child.run_id)
        .await
        .unwrap();
    assert_eq!(child.final_answer.as_deref(), Some(long_answer.as_str()));
}

/// A child past its own `max_duration_ms` is cut off mid-call and ends `timed_out`; its parent
/// reads it as a failed task and goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_child_past_its_deadline_is_a_failed_task_for_its_parent() {
    // The worker thinks for a minute: only its deadline ends it.
    let model = PolicyModel::new(Duration::from_secs(60), fan_out_policy(1, "worker"));
    let quick = PolicyModel::new(Duration::from_millis(1), fan_out_policy(1, "worker"));
    let node = node(Arc::clone(&model), Some(quick), PermitLimits::default());
    let mut worker = agent("worker", Vec::new());
    worker.config.limits.max_duration_ms = Some(500);
    let mut boss = agent("boss", vec![worker]);
    boss.config.model = "test:quick".into();
    let root = start(&node.coordinator, "job", boss.config).await;
    let state = wait_for(&node.coordinator, &root, RunStatus::is_terminal).await;
    assert_eq!(state.status, RunStatus::Completed, "{state:?}");
    let store = node.coordinator.store();
    let child = &store.run_tree(&root).await.unwrap()[1];
    let child = store.load_state(&child.run_id).await.unwrap();
    assert_eq!(
        (child.status, child.stop_reason),
        (RunStatus::Failed, Some(StopReason::TimedOut))
    );
    let history = store.history(&state.session_id).await.unwrap();
    let joined: Value = serde_json::from_str(tool_results(&history)[0]).unwrap();
    assert_eq!(joined["results"][0]["status"], "failed", "{joined}");
    assert_eq!(
        joined["results"][0]["error"], "the run failed: timed_out",
        "{joined}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streak_shows_the_model_exactly_the_stored_context_a_steer_included() {
    let requests: Arc<std::sync::Mutex<Vec<Vec<Message>>>> = Arc::default();
    let model = PolicyModel::new(Duration::from_millis(150), {
        let requests = Arc::clone(&requests);
        move |request| {
            requests.lock().unwrap().push(request.messages.clone());
            let calls = tool_results(&request.messages).len();
            if calls == 2 {
                return text("two sums".into());
            }
            ModelReply {
                tool_calls: vec![ToolCall {
                    id: format!("call-{calls}"),
                    name: "add".into(),
                    arguments: json!({"a": calls, "b": 1}),
                }],
                ..ModelReply::default()
            }
        }
    });
    let node = node(model, None, PermitLimits::default());
    let mut config = agent("adder", Vec::new()).config;
    config.tools = Registry::builtin().specs();
    let session = node
        .coordinator
        .create_session(SessionSpec::default())
        .await
        .unwrap()
        .id;
    let run = node
        .coordinator
        .submit(
            &session,
            "add twice".into(),
            config.clone(),
            Multitask::Enqueue,
        )
        .await
        .unwrap()
        .run_id;
    // Lands while the first model call is held: the tools step's commit takes it in, and the
    // second model call is the streak's own, made from the context it kept.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let steered = node
        .coordinator
        .submit(&session, "and say so".into(), config, Multitask::Steer)
        .await
        .unwrap();
    assert_eq!(steered.run_id, run, "the steer joined the active run");
    let state = wait_for(&node.coordinator, &run, RunStatus::is_terminal).await;
    assert_eq!(state.final_answer.as_deref(), Some("two sums"), "{state:?}");

    let stored: Vec<Message> = (node.coordinator.store().context(&session, &run).await)
        .unwrap()
        .into_iter()
        .map(|m| m.message)
        .collect();
    let requests = requests.lock().unwrap().clone();
    assert_eq!(requests.len(), 3, "{requests:#?}");
    for (call, sent) in requests.iter().enumerate() {
        assert!(
            stored.starts_with(sent),
            "model call {call} was shown {sent:#?}, which is not how the store's context \
             {stored:#?} began"
        );
    }
    let steer_seen = |sent: &Vec<Message>| sent.iter().any(|m| m.content == "and say so");
    assert!(!steer_seen(&requests[0]), "{:#?}", requests[0]);
    assert!(steer_seen(&requests[1]), "{:#?}", requests[1]);
    assert_eq!(requests[2].len(), stored.len() - 1, "all but the answer");
}
