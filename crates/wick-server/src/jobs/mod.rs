//! Background jobs beside serving (reference E.9): fine-tuning runs `wick train` as a child
//! process, one at a time, at a lower CPU priority than requests. Each job has a row in a
//! small SQLite table (`db`) and an NDJSON event log that `GET /api/jobs/{id}/stream` tails.
//!
//! A child process (not a thread) because training holds its own copy of the base in f32 and
//! saturates the cores: a crash or an out-of-memory kill of the trainer never takes the
//! server down, cancelling is a signal, and the kernel's scheduler (`nice`) keeps requests
//! ahead of it.
pub mod db;
pub mod finetune;

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use rand::Rng;
use serde_json::{json, Value};

use db::{now, JobDb};
pub use db::{JobRow, Status};
use finetune::FinetuneConfig;

/// Where jobs live and what runs them.
#[derive(Debug, Clone)]
pub struct JobsConfig {
    /// The table and the event logs (`$WICK_HOME/jobs`).
    pub dir: PathBuf,
    /// Where an adapter goes when a job names no `adapter_path` (`$WICK_HOME/adapters`).
    pub adapters_dir: PathBuf,
    /// The `wick` binary (`wick train` runs the job).
    pub trainer: PathBuf,
    /// Seconds a cancelled trainer gets to save its adapter before it is killed.
    pub cancel_grace: Duration,
}

/// Why a job call failed.
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    /// No job with this id.
    #[error("job {0} not found")]
    NotFound(String),
    /// The table cannot be read or written.
    #[error("the job table failed: {0}")]
    Db(#[from] rusqlite::Error),
    /// An event log cannot be written.
    #[error("cannot write {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

/// The child running now.
struct Running {
    id: String,
    pid: u32,
    cancelled: bool,
}

/// The job system: the table, the queue and the one runner thread.
pub struct Jobs {
    db: Mutex<JobDb>,
    cfg: JobsConfig,
    running: Mutex<Option<Running>>,
    wake: Condvar,
    queued: Mutex<bool>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A new id: `job-` and 12 hex digits.
fn new_id() -> String {
    format!(
        "job-{:012x}",
        rand::rng().random::<u64>() & 0xffff_ffff_ffff
    )
}

impl Jobs {
    /// Opens the table (marking the unfinished jobs of a gone server `zombie`) and starts
    /// the runner thread.
    pub fn open(cfg: JobsConfig) -> Result<Arc<Jobs>, String> {
        std::fs::create_dir_all(&cfg.dir)
            .map_err(|e| format!("cannot create {}: {e}", cfg.dir.display()))?;
        let path = cfg.dir.join("jobs.sqlite");
        let (db, zombies) =
            JobDb::open(&path).map_err(|e| format!("cannot open {}: {e}", path.display()))?;
        if zombies > 0 {
            tracing::warn!(
                zombies,
                "jobs left unfinished by a stopped server are marked zombie"
            );
        }
        let jobs = Arc::new(Jobs {
            db: Mutex::new(db),
            cfg,
            running: Mutex::new(None),
            wake: Condvar::new(),
            queued: Mutex::new(true),
        });
        let runner = jobs.clone();
        std::thread::Builder::new()
            .name("wick-jobs".into())
            .spawn(move || runner.run_forever())
            .map_err(|e| format!("cannot start the job runner: {e}"))?;
        Ok(jobs)
    }

    /// Where an adapter goes when a job names none.
    pub fn adapters_dir(&self) -> &Path {
        &self.cfg.adapters_dir
    }

    /// Queues a fine-tune job; returns its id.
    pub fn submit_finetune(&self, config: &FinetuneConfig) -> Result<String, JobError> {
        let id = new_id();
        let log = self.cfg.dir.join(format!("{id}.ndjson"));
        File::create(&log).map_err(|source| JobError::Io {
            path: log.clone(),
            source,
        })?;
        let value = serde_json::to_value(config).unwrap_or(Value::Null);
        lock(&self.db).insert(
            &id,
            "finetune",
            &value,
            &log.display().to_string(),
            Some(&config.adapter_path),
        )?;
        append_event(&log, &json!({"type": "queued", "ts": now()}));
        *lock(&self.queued) = true;
        self.wake.notify_all();
        tracing::info!(job = %id, method = %config.method, model = %config.model_dir, "fine-tune job queued");
        Ok(id)
    }

    /// One job.
    pub fn get(&self, id: &str) -> Result<JobRow, JobError> {
        lock(&self.db)
            .get(id)?
            .ok_or_else(|| JobError::NotFound(id.into()))
    }

    /// The newest jobs first.
    pub fn list(&self) -> Result<Vec<JobRow>, JobError> {
        Ok(lock(&self.db).list(200)?)
    }

    /// Cancels a queued job at once, or asks a running trainer to stop (it saves the adapter
    /// so far; killed after the grace period). A finished job is left as it is. Returns the
    /// status after the call.
    pub fn cancel(self: &Arc<Self>, id: &str) -> Result<Status, JobError> {
        let mut running = lock(&self.running);
        let row = self.get(id)?;
        match (&mut *running, row.status) {
            (Some(r), Status::Running) if r.id == id => {
                if !r.cancelled {
                    r.cancelled = true;
                    signal(r.pid, libc::SIGTERM);
                    let (pid, grace) = (r.pid, self.cfg.cancel_grace);
                    let (id, jobs) = (id.to_string(), self.clone());
                    let watch = std::thread::Builder::new()
                        .name("wick-job-cancel".into())
                        .spawn(move || {
                            std::thread::sleep(grace);
                            // Still recorded as running: the child is not reaped, so the
                            // pid is still ours to signal.
                            let running = lock(&jobs.running);
                            if running.as_ref().is_some_and(|r| r.pid == pid) {
                                tracing::warn!(job = %id, "the trainer ignored SIGTERM; killing it");
                                signal(pid, libc::SIGKILL);
                            }
                        });
                    if watch.is_err() {
                        signal(pid, libc::SIGKILL);
                    }
                }
                Ok(Status::Running)
            }
            (_, Status::Queued) => {
                if lock(&self.db).finish(
                    id,
                    Status::Cancelled,
                    Some("cancelled before it started"),
                )? {
                    append_event(
                        Path::new(&row.log_path),
                        &json!({"type": "cancelled", "ts": now()}),
                    );
                }
                Ok(Status::Cancelled)
            }
            (_, status) => Ok(status),
        }
    }

    /// The complete lines of a job's event log from byte `offset`, and the offset after them.
    pub fn events_from(&self, row: &JobRow, offset: u64) -> (Vec<String>, u64) {
        let Ok(mut f) = File::open(&row.log_path) else {
            return (Vec::new(), offset);
        };
        if f.seek(SeekFrom::Start(offset)).is_err() {
            return (Vec::new(), offset);
        }
        let mut text = String::new();
        if f.take(8 << 20).read_to_string(&mut text).is_err() {
            return (Vec::new(), offset);
        }
        let Some(end) = text.rfind('\n') else {
            return (Vec::new(), offset);
        };
        let lines = text[..end]
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(str::to_string)
            .collect();
        (lines, offset + end as u64 + 1)
    }

    fn run_forever(self: Arc<Self>) {
        loop {
            let next = lock(&self.db).next_queued();
            match next {
                Ok(Some(job)) => self.run(job),
                Ok(None) => {
                    let mut queued = lock(&self.queued);
                    if !*queued {
                        queued = self
                            .wake
                            .wait_timeout(queued, Duration::from_secs(5))
                            .map(|(g, _)| g)
                            .unwrap_or_else(|p| p.into_inner().0);
                    }
                    *queued = false;
                }
                Err(e) => {
                    tracing::error!(error = %e, "the job table failed; retrying");
                    std::thread::sleep(Duration::from_secs(5));
                }
            }
        }
    }

    fn run(&self, job: JobRow) {
        let log = PathBuf::from(&job.log_path);
        let config: FinetuneConfig = match serde_json::from_value(job.config.clone()) {
            Ok(c) => c,
            Err(e) => {
                let error = format!("the stored configuration cannot be read: {e}");
                append_event(
                    &log,
                    &json!({"type": "failed", "error": error, "ts": now()}),
                );
                let _ = lock(&self.db).finish(&job.id, Status::Failed, Some(&error));
                return;
            }
        };
        let mut cmd = Command::new(&self.cfg.trainer);
        cmd.args(config.trainer_args())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .env("WICK_LOG", "warn");
        lower_priority(&mut cmd);
        // Started and recorded under the lock a cancel takes, so a cancel sees either a
        // queued job or a running child, never the moment between.
        let spawned = {
            let mut running = lock(&self.running);
            match lock(&self.db).start(&job.id) {
                Ok(true) => {}
                Ok(false) => return, // cancelled meanwhile
                Err(e) => {
                    tracing::error!(job = %job.id, error = %e, "cannot start a job");
                    return;
                }
            }
            append_event(&log, &json!({"type": "started", "ts": now()}));
            let spawned = cmd.spawn();
            if let Ok(child) = &spawned {
                *running = Some(Running {
                    id: job.id.clone(),
                    pid: child.id(),
                    cancelled: false,
                });
            }
            spawned
        };
        let mut child = match spawned {
            Ok(c) => c,
            Err(e) => {
                let error = format!(
                    "cannot start the trainer {}: {e}",
                    self.cfg.trainer.display()
                );
                append_event(
                    &log,
                    &json!({"type": "failed", "error": error, "ts": now()}),
                );
                let _ = lock(&self.db).finish(&job.id, Status::Failed, Some(&error));
                return;
            }
        };
        tracing::info!(job = %job.id, pid = child.id(), "fine-tune job started");
        let tail = Arc::new(Mutex::new(Vec::<String>::new()));
        let stderr = child.stderr.take().map(|err| {
            let (log, tail) = (log.clone(), tail.clone());
            std::thread::spawn(move || {
                for line in BufReader::new(err).lines().map_while(Result::ok) {
                    let line = line.trim_end().to_string();
                    if line.is_empty() {
                        continue;
                    }
                    append_event(&log, &json!({"type": "log", "line": line}));
                    let mut t = lock(&tail);
                    t.push(line);
                    let excess = t.len().saturating_sub(20);
                    t.drain(..excess);
                }
            })
        });
        let mut last_train: Option<Value> = None;
        let mut last_val: Option<Value> = None;
        if let Some(out) = child.stdout.take() {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                let event = match serde_json::from_str::<Value>(&line) {
                    Ok(v) if v.get("type").and_then(Value::as_str).is_some() => v,
                    _ if line.trim().is_empty() => continue,
                    _ => json!({"type": "log", "line": line}),
                };
                append_event(&log, &event);
                self.record(&job.id, &event, &mut last_train, &mut last_val);
            }
        }
        let exit = child.wait();
        if let Some(t) = stderr {
            let _ = t.join();
        }
        let cancelled = lock(&self.running).take().is_some_and(|r| r.cancelled);
        let output = config.adapter_path.clone();
        let (status, error, event) = match exit {
            _ if cancelled => (
                Status::Cancelled,
                Some("cancelled on request".to_string()),
                json!({"type": "cancelled", "ts": now(), "output_dir": output}),
            ),
            Ok(s) if s.success() => {
                let summary = json!({
                    "steps": last_train.as_ref().and_then(|m| m.get("step")).cloned(),
                    "train_loss": last_train.as_ref().and_then(|m| m.get("loss")).cloned(),
                    "val_loss": last_val.as_ref().and_then(|m| m.get("loss")).cloned(),
                    "tokens_per_sec": last_train.as_ref().and_then(|m| m.get("tokens_per_sec")).cloned(),
                });
                (
                    Status::Done,
                    None,
                    json!({"type": "done", "ts": now(), "output_dir": output, "summary": summary}),
                )
            }
            other => {
                let tail = lock(&tail);
                let reason = tail
                    .iter()
                    .rev()
                    .find(|l| l.starts_with("Error"))
                    .or(tail.last())
                    .cloned()
                    .unwrap_or_default();
                let how = match other {
                    Ok(s) => exit_words(s),
                    Err(e) => format!("could not be waited for: {e}"),
                };
                let error = if reason.is_empty() {
                    format!("the trainer {how}")
                } else {
                    format!("the trainer {how}: {reason}")
                };
                (
                    Status::Failed,
                    Some(error.clone()),
                    json!({"type": "failed", "error": error, "ts": now()}),
                )
            }
        };
        // The last event is written before the row turns terminal: a stream that sees the
        // terminal row has every event to read.
        append_event(&log, &event);
        if let Err(e) = lock(&self.db).finish(&job.id, status, error.as_deref()) {
            tracing::error!(job = %job.id, error = %e, "cannot record the end of a job");
        }
        tracing::info!(job = %job.id, status = status.name(), "fine-tune job ended");
    }

    /// Keeps the row's progress and message current.
    fn record(
        &self,
        id: &str,
        event: &Value,
        last_train: &mut Option<Value>,
        last_val: &mut Option<Value>,
    ) {
        let progress = event.get("progress").and_then(Value::as_f64);
        let message = match event["type"].as_str() {
            Some("stage") => event["message"]
                .as_str()
                .map(str::to_string)
                .or_else(|| event["stage"].as_str().map(str::to_string)),
            Some("metric") => {
                let kind = event["kind"].as_str().unwrap_or("train");
                let text = format!(
                    "step {} {kind} loss {:.4}",
                    event["step"],
                    event["loss"].as_f64().unwrap_or(f64::NAN)
                );
                if kind == "val" {
                    *last_val = Some(event.clone());
                } else {
                    *last_train = Some(event.clone());
                }
                Some(text)
            }
            _ => None,
        };
        if let Some(m) = message {
            if let Err(e) = lock(&self.db).progress(id, progress, &m) {
                tracing::warn!(job = %id, error = %e, "cannot record job progress");
            }
        }
    }
}

/// Appends one event line to a job's log: one write per event, so concurrent appenders (the
/// stdout and stderr readers) never interleave a line.
fn append_event(log: &Path, event: &Value) {
    let line = format!("{event}\n");
    let written = OpenOptions::new()
        .append(true)
        .create(true)
        .open(log)
        .and_then(|mut f| f.write_all(line.as_bytes()));
    if let Err(e) = written {
        tracing::warn!(path = %log.display(), error = %e, "cannot append a job event");
    }
}

fn exit_words(s: std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (s.code(), s.signal()) {
        (Some(c), _) => format!("exited with status {c}"),
        (None, Some(9)) => "was killed (SIGKILL: out of memory?)".into(),
        (None, Some(sig)) => format!("was stopped by signal {sig}"),
        _ => "ended".into(),
    }
}

fn signal(pid: u32, sig: libc::c_int) {
    if let Ok(pid) = libc::pid_t::try_from(pid) {
        // SAFETY: signalling a child we started (and have not reaped).
        unsafe { libc::kill(pid, sig) };
    }
}

/// The trainer runs at `nice 10` (requests first) and, on Linux, dies with the server.
fn lower_priority(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            libc::setpriority(libc::PRIO_PROCESS, 0, 10);
            #[cfg(target_os = "linux")]
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
            Ok(())
        });
    }
}

#[cfg(test)]
mod tests;
