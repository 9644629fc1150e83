//! The runner against a stand-in trainer (a shell script speaking `wick train --events`), so
//! queueing, events, failure and cancellation are checked without training anything.
use std::os::unix::fs::PermissionsExt;
use std::time::Instant;

use super::finetune::FinetuneSubmit;
use super::*;
use crate::extract::RequestBody;

const TRAINER: &str = r#"#!/bin/sh
# $2 is model_dir: it picks the behaviour.
case "$2" in
ok)
  echo '{"type":"stage","stage":"load","progress":0}'
  echo "base loaded" >&2
  for i in 1 2 3; do
    echo "{\"type\":\"metric\",\"kind\":\"train\",\"step\":$i,\"loss\":$((4 - i)).5,\"progress\":0.$((i * 3))}"
  done
  echo '{"type":"metric","kind":"val","step":3,"loss":1.25}'
  echo "serve it: wick serve ok --adapter x"
  ;;
fail)
  echo "Error: boom at train.jsonl line 3" >&2
  exit 2
  ;;
slow)
  trap 'echo "stopping" >&2; exit 1' TERM
  echo '{"type":"stage","stage":"train","progress":0}'
  i=0
  while [ $i -lt 300 ]; do sleep 0.1; i=$((i + 1)); done
  ;;
esac
"#;

fn setup() -> (tempfile::TempDir, Arc<Jobs>) {
    let dir = tempfile::tempdir().unwrap();
    let trainer = dir.path().join("fake-wick");
    std::fs::write(&trainer, TRAINER).unwrap();
    std::fs::set_permissions(&trainer, std::fs::Permissions::from_mode(0o755)).unwrap();
    let jobs = Jobs::open(JobsConfig {
        dir: dir.path().join("jobs"),
        adapters_dir: dir.path().join("adapters"),
        trainer,
        cancel_grace: Duration::from_secs(10),
    })
    .unwrap();
    (dir, jobs)
}

fn config(model: &str, adapters: &Path) -> FinetuneConfig {
    FinetuneSubmit::from_json(&json!({"model_dir": model, "data_dir": "/data", "iters": 3}))
        .unwrap()
        .check(
            |_, _| Ok(json!({"format": "text", "n_train": 1, "n_valid": 0})),
            adapters,
            7,
        )
        .unwrap()
}

fn wait_for(jobs: &Jobs, id: &str, done: impl Fn(&JobRow) -> bool) -> JobRow {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let row = jobs.get(id).unwrap();
        if done(&row) {
            return row;
        }
        assert!(Instant::now() < deadline, "job never got there: {row:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn events(jobs: &Jobs, row: &JobRow) -> Vec<Value> {
    let (lines, _) = jobs.events_from(row, 0);
    lines
        .iter()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn a_job_logs_its_events_in_order_and_ends_done_with_a_summary() {
    let (dir, jobs) = setup();
    let id = jobs
        .submit_finetune(&config("ok", &dir.path().join("adapters")))
        .unwrap();
    let row = wait_for(&jobs, &id, |r| r.status.is_terminal());
    assert_eq!(row.status, Status::Done, "{row:?}");
    assert_eq!(row.progress, 1.0);
    assert!(row.started_at.is_some() && row.ended_at.is_some());
    assert_eq!(row.config["iters"], 3);
    let all = events(&jobs, &row);
    let types: Vec<&str> = all.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(types.first(), Some(&"queued"));
    assert_eq!(types[1], "started");
    assert_eq!(types.last(), Some(&"done"));
    let steps: Vec<i64> = all
        .iter()
        .filter(|e| e["type"] == "metric" && e["kind"] == "train")
        .map(|e| e["step"].as_i64().unwrap())
        .collect();
    assert_eq!(steps, [1, 2, 3]);
    let lines: Vec<&str> = all.iter().filter_map(|e| e["line"].as_str()).collect();
    assert!(lines.contains(&"base loaded") && lines.iter().any(|l| l.starts_with("serve it")));
    let done = all.last().unwrap();
    assert_eq!(done["summary"]["train_loss"], 1.5);
    assert_eq!(done["summary"]["val_loss"], 1.25);
    assert_eq!(
        done["output_dir"],
        dir.path().join("adapters/adapter-7").display().to_string()
    );
    // Reading from the offset it returned gives nothing new.
    let (_, end) = jobs.events_from(&row, 0);
    assert!(jobs.events_from(&row, end).0.is_empty());
}

#[test]
fn a_failing_trainer_fails_the_job_with_its_error_line() {
    let (dir, jobs) = setup();
    let id = jobs
        .submit_finetune(&config("fail", &dir.path().join("adapters")))
        .unwrap();
    let row = wait_for(&jobs, &id, |r| r.status.is_terminal());
    assert_eq!(row.status, Status::Failed);
    let error = row.error.unwrap();
    assert!(
        error.contains("exited with status 2") && error.contains("boom at train.jsonl line 3"),
        "{error}"
    );
    let last = events(&jobs, &jobs.get(&id).unwrap()).pop().unwrap();
    assert_eq!(last["type"], "failed");
}

#[test]
fn one_job_runs_at_a_time_and_both_queued_and_running_jobs_cancel() {
    let (dir, jobs) = setup();
    let adapters = dir.path().join("adapters");
    let first = jobs.submit_finetune(&config("slow", &adapters)).unwrap();
    let second = jobs.submit_finetune(&config("ok", &adapters)).unwrap();
    wait_for(&jobs, &first, |r| r.status == Status::Running);
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(jobs.get(&second).unwrap().status, Status::Queued);
    assert_eq!(jobs.cancel(&second).unwrap(), Status::Cancelled);
    // The trainer gets SIGTERM and stops on its own.
    assert_eq!(jobs.cancel(&first).unwrap(), Status::Running);
    let row = wait_for(&jobs, &first, |r| r.status.is_terminal());
    assert_eq!(row.status, Status::Cancelled, "{row:?}");
    let all = events(&jobs, &row);
    assert!(all.iter().any(|e| e["line"] == "stopping"), "{all:?}");
    assert_eq!(all.last().unwrap()["type"], "cancelled");
    // A finished job stays as it is; an unknown id is an error.
    assert_eq!(jobs.cancel(&first).unwrap(), Status::Cancelled);
    assert!(matches!(
        jobs.cancel("job-nope"),
        Err(JobError::NotFound(_))
    ));
    let second_row = jobs.get(&second).unwrap();
    assert_eq!(second_row.status, Status::Cancelled);
    assert!(second_row.started_at.is_none());
    let ids: Vec<String> = jobs.list().unwrap().into_iter().map(|r| r.id).collect();
    assert_eq!(ids.len(), 2);
}
