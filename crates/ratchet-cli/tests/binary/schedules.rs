//! Schedules across real processes: a `serve` and a `worker` process on one database both run
//! the scheduler of an every-second schedule, and one of them is killed with SIGKILL right
//! around a slot's instant, again and again, the other always alive (the killed one is
//! started again before the next kill). Afterwards every slot from the first to the last was
//! decided exactly once and fired — none twice, none lost — and each fired run completed.

use std::collections::BTreeSet;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use ratchet_core::{RunStatus, ScheduleId, SlotOutcome};
use ratchet_store::Store;
use serde_json::json;

use crate::common::{postgres, sqlite};
use crate::scale::{Process, migrate, open, serve, worker, write_script};

const DEADLINE: Duration = Duration::from_secs(120);
/// Kills, alternating between the two processes.
const KILLS: usize = 4;

mod sqlite {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_slot_fires_once_while_processes_are_killed_around_it() {
        let Some(db) = super::sqlite() else { return };
        super::kills_around_slots(&db.url).await;
    }
}

mod postgres {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_slot_fires_once_while_processes_are_killed_around_it() {
        let Some(db) = super::postgres() else { return };
        super::kills_around_slots(&db.url).await;
    }
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

/// Sleeps until `offset_ms` from the next whole second (a slot of an every-second schedule).
async fn until_around_next_slot(offset_ms: i64) {
    let now = now_ms();
    let target = (now / 1000 + 1) * 1000 + offset_ms;
    let target = if target <= now { target + 1000 } else { target };
    tokio::time::sleep(Duration::from_millis((target - now) as u64)).await;
}

/// The slots decided so far, oldest first.
async fn decided(store: &dyn Store, id: &ScheduleId) -> Vec<ratchet_store::ScheduleSlot> {
    let mut slots = store.schedule_slots(id, None, 1000).await.unwrap();
    slots.reverse();
    slots
}

async fn kills_around_slots(db: &str) {
    let dir = tempfile::tempdir().unwrap();
    let script = write_script(dir.path(), &json!({"replies": [{"text": "tick"}]}));
    migrate(db);
    let (mut api, base) = serve(db, dir.path(), &script, "2");
    let mut other: Process = worker("worker", db);
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let created: serde_json::Value = http
        .post(format!("{base}/v1/schedules"))
        .json(&json!({
            "message": "tick",
            "every_ms": 1000,
            "session": "new",
            "overlap": "enqueue",
            "catch_up": "skip",
        }))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let id = ScheduleId::parse(created["id"].as_str().unwrap()).unwrap();
    let store = open(db);

    // Each kill lands at another place around a slot's instant: just before it, on it, and
    // just after (when a pass may be inside its transaction).
    for kill in 0..KILLS {
        let offset = [-25, 0, 5, 40][kill % 4];
        until_around_next_slot(offset).await;
        let victim = if kill % 2 == 0 { &mut other } else { &mut api };
        victim.kill_9();
        // The survivor keeps deciding slots alone for a while.
        tokio::time::sleep(Duration::from_millis(1_600)).await;
        if kill % 2 == 0 {
            other = worker("worker", db);
        } else {
            let (restarted, _) = serve(db, dir.path(), &script, "2");
            api = restarted;
        }
        tokio::time::sleep(Duration::from_millis(700)).await;
    }
    let stopped_at = now_ms();
    for process in [&mut api, &mut other] {
        let status = process.terminate();
        assert!(
            status.success(),
            "{} stops on SIGTERM:\n{}",
            process.name,
            process.log()
        );
    }

    let slots = decided(store.as_ref(), &id).await;
    assert!(
        slots.len() >= KILLS * 2,
        "a slot a second went by: {} slots",
        slots.len()
    );
    let times: Vec<i64> = slots.iter().map(|s| s.slot).collect();
    assert!(
        times.windows(2).all(|w| w[1] - w[0] == 1000),
        "every whole second from the first slot on, none twice, none lost: {times:?}"
    );
    assert!(
        *times.last().unwrap() >= stopped_at - 2_000,
        "slots were decided up to the end: last {:?}, stopped at {stopped_at}",
        times.last()
    );
    for slot in &slots {
        assert!(
            slot.outcome == SlotOutcome::Fired && !slot.manual,
            "a process was alive at every slot, so each fired: {slot:?}"
        );
    }
    let fired: BTreeSet<_> = slots.iter().map(|s| s.run_id.clone().unwrap()).collect();
    assert_eq!(fired.len(), slots.len(), "one run per slot");
    let runs: Vec<_> = (store.list_runs().await.unwrap().into_iter())
        .filter(|r| r.schedule_id.as_ref() == Some(&id))
        .collect();
    assert_eq!(
        runs.len(),
        slots.len(),
        "no run without its slot: {runs:#?}"
    );
    for run in &runs {
        let slot = slots
            .iter()
            .find(|s| s.run_id.as_ref() == Some(&run.run_id));
        assert_eq!(slot.map(|s| s.slot), run.slot, "{run:?}");
    }

    // The runs a killed process started are finished by a process started afterwards.
    let (mut finisher, _) = serve(db, dir.path(), &script, "4");
    let started = Instant::now();
    loop {
        let statuses: Vec<RunStatus> = (store.list_runs().await.unwrap().into_iter())
            .filter(|r| r.schedule_id.as_ref() == Some(&id) && fired.contains(&r.run_id))
            .map(|r| r.status)
            .collect();
        if statuses.iter().all(|s| *s == RunStatus::Completed) {
            break;
        }
        assert!(
            started.elapsed() < DEADLINE,
            "fired runs never completed: {statuses:?}\n{}",
            finisher.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    finisher.terminate();
}

/// `ratchet schedules …` against a server: every command, and a refusal that says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_manages_a_servers_schedules() {
    let db = sqlite().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let script = write_script(dir.path(), &json!({"replies": [{"text": "tick"}]}));
    migrate(&db.url);
    let (mut api, base) = serve(&db.url, dir.path(), &script, "2");
    let cli = |args: &[&str]| {
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_ratchet"));
        command
            .args(["schedules"])
            .args(args)
            .args(["--server", &base]);
        crate::common::output_within_deadline(&mut command, "")
    };
    let json_of = |output: &std::process::Output| -> serde_json::Value {
        assert!(
            output.status.success(),
            "{}{}",
            crate::common::stdout_of(output),
            crate::common::stderr_of(output)
        );
        serde_json::from_str(&crate::common::stdout_of(output)).unwrap()
    };

    let refused = cli(&[
        "create",
        "--every-ms",
        "500",
        "--session",
        "new",
        "--overlap",
        "skip",
        "--catch-up",
        "one",
        "tick",
    ]);
    assert!(!refused.status.success());
    let said = crate::common::stderr_of(&refused);
    assert!(said.contains("every_ms must be at least 1000"), "{said}");
    let incomplete = cli(&["create", "--every-ms", "1000", "tick"]);
    assert!(
        crate::common::stderr_of(&incomplete).contains("--session, --overlap, --catch-up"),
        "{}",
        crate::common::stderr_of(&incomplete)
    );

    let created = json_of(&cli(&[
        "create",
        "--cron",
        "0 9 * * *",
        "--timezone",
        "Asia/Tokyo",
        "--session",
        "new",
        "--overlap",
        "cancel-previous",
        "--catch-up",
        "all",
        "--paused",
        "--json",
        "the digest",
    ]));
    let id = created["id"].as_str().unwrap().to_owned();
    assert_eq!(
        (
            &created["overlap"],
            &created["catch_up"],
            &created["paused"],
            &created["timezone"]
        ),
        (
            &json!("cancel_previous"),
            &json!("all"),
            &json!(true),
            &json!("Asia/Tokyo")
        )
    );
    let listed = json_of(&cli(&["list", "--json"]));
    assert_eq!(listed[0]["id"], json!(id));
    let text = crate::common::stdout_of(&cli(&["get", &id]));
    assert!(
        text.contains("cron \"0 9 * * *\" in Asia/Tokyo") && text.contains("paused"),
        "{text}"
    );

    let resumed = json_of(&cli(&["resume", &id, "--json"]));
    assert!(resumed["next_fire_at"].is_i64(), "{resumed}");
    let paused = json_of(&cli(&["pause", &id, "--json"]));
    assert_eq!(paused["paused"], true);
    let updated = json_of(&cli(&[
        "update",
        &id,
        "--message",
        "the new digest",
        "--json",
    ]));
    assert_eq!(updated["message"], "the new digest");
    let fired = json_of(&cli(&["trigger", &id, "--json"]));
    assert_eq!(
        (&fired["manual"], &fired["outcome"]),
        (&json!(true), &json!("fired"))
    );
    let runs = crate::common::stdout_of(&cli(&["runs", &id]));
    let run = fired["run_id"].as_str().unwrap();
    assert!(
        runs.contains("(manual)  fired") && runs.contains(run),
        "{runs}"
    );
    let deleted = cli(&["delete", &id]);
    assert!(crate::common::stdout_of(&deleted).contains("is deleted"));
    let gone = cli(&["get", &id]);
    assert!(!gone.status.success());
    assert!(
        crate::common::stderr_of(&gone).contains("404"),
        "{}",
        crate::common::stderr_of(&gone)
    );
    api.terminate();
}
