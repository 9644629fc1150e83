//! The job table: one SQLite file in wick's home, so jobs (and what became of them) survive a
//! restart. Several servers may share a home; each row names the process that owns it, and a
//! server marks `zombie` only the unfinished rows whose owner is gone.
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use rusqlite::{params, Connection, OptionalExtension, Row};
use serde::Serialize;
use serde_json::Value;

/// What became of a job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// Waiting for the training slot.
    Queued,
    /// Training now.
    Running,
    /// Finished; its output is written.
    Done,
    /// Stopped by an error.
    Failed,
    /// Stopped on request (the adapter so far is kept).
    Cancelled,
    /// Its server went away before it finished.
    Zombie,
}

impl Status {
    /// The name stored and reported.
    pub fn name(self) -> &'static str {
        match self {
            Status::Queued => "queued",
            Status::Running => "running",
            Status::Done => "done",
            Status::Failed => "failed",
            Status::Cancelled => "cancelled",
            Status::Zombie => "zombie",
        }
    }

    fn parse(s: &str) -> Status {
        match s {
            "queued" => Status::Queued,
            "running" => Status::Running,
            "done" => Status::Done,
            "failed" => Status::Failed,
            "cancelled" => Status::Cancelled,
            _ => Status::Zombie,
        }
    }

    /// Whether the job can change no more.
    pub fn is_terminal(self) -> bool {
        !matches!(self, Status::Queued | Status::Running)
    }
}

/// One job row.
#[derive(Debug, Clone, Serialize)]
pub struct JobRow {
    /// `job-<hex>`.
    pub id: String,
    /// `finetune`.
    pub kind: String,
    /// Its status.
    pub status: Status,
    /// The submitted configuration (defaults filled in).
    pub config: Value,
    /// 0..1.
    pub progress: f64,
    /// The latest stage or metric, in words.
    pub message: Option<String>,
    /// The NDJSON event log.
    pub log_path: String,
    /// Where the output goes (the adapter directory).
    pub output_path: Option<String>,
    /// Why it failed.
    pub error: Option<String>,
    /// Unix seconds.
    pub created_at: u64,
    /// Unix seconds.
    pub started_at: Option<u64>,
    /// Unix seconds.
    pub ended_at: Option<u64>,
}

/// Unix seconds now.
pub fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    kind TEXT NOT NULL,
    status TEXT NOT NULL,
    config_json TEXT NOT NULL,
    progress REAL NOT NULL DEFAULT 0,
    message TEXT,
    log_path TEXT NOT NULL,
    output_path TEXT,
    error TEXT,
    owner_pid INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    started_at INTEGER,
    ended_at INTEGER
);
CREATE INDEX IF NOT EXISTS jobs_by_status ON jobs(status, created_at);
";

const COLUMNS: &str = "id, kind, status, config_json, progress, message, log_path, output_path, \
                       error, created_at, started_at, ended_at";

/// The job table.
pub struct JobDb {
    conn: Connection,
    pid: u32,
}

fn row(r: &Row<'_>) -> rusqlite::Result<JobRow> {
    let config: String = r.get(3)?;
    Ok(JobRow {
        id: r.get(0)?,
        kind: r.get(1)?,
        status: Status::parse(&r.get::<_, String>(2)?),
        config: serde_json::from_str(&config).unwrap_or(Value::Null),
        progress: r.get(4)?,
        message: r.get(5)?,
        log_path: r.get(6)?,
        output_path: r.get(7)?,
        error: r.get(8)?,
        created_at: r.get::<_, i64>(9)?.max(0) as u64,
        started_at: r.get::<_, Option<i64>>(10)?.map(|t| t.max(0) as u64),
        ended_at: r.get::<_, Option<i64>>(11)?.map(|t| t.max(0) as u64),
    })
}

/// Whether process `pid` is alive (signal 0 probes without signalling).
fn alive(pid: i64) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    // SAFETY: kill with signal 0 only checks that the process exists.
    pid > 0
        && (unsafe { libc::kill(pid, 0) } == 0
            || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM))
}

impl JobDb {
    /// Opens (creating) the table at `path` and marks `zombie` the unfinished jobs whose
    /// server is gone; returns how many it marked too.
    pub fn open(path: &Path) -> rusqlite::Result<(JobDb, usize)> {
        let conn = Connection::open(path)?;
        conn.busy_timeout(std::time::Duration::from_secs(10))?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "NORMAL")?;
        conn.execute_batch(SCHEMA)?;
        let db = JobDb {
            conn,
            pid: std::process::id(),
        };
        let orphans: Vec<(String, i64)> = {
            let mut q = db
                .conn
                .prepare("SELECT id, owner_pid FROM jobs WHERE status IN ('queued', 'running')")?;
            let rows = q.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?;
            rows.collect::<rusqlite::Result<_>>()?
        };
        let mut marked = 0;
        for (id, owner) in orphans {
            if owner == i64::from(db.pid) || !alive(owner) {
                db.finish(
                    &id,
                    Status::Zombie,
                    Some("the server stopped before this job finished"),
                )?;
                marked += 1;
            }
        }
        Ok((db, marked))
    }

    /// Adds a queued job owned by this process.
    pub fn insert(
        &self,
        id: &str,
        kind: &str,
        config: &Value,
        log_path: &str,
        output_path: Option<&str>,
    ) -> rusqlite::Result<()> {
        self.conn.execute(
            "INSERT INTO jobs (id, kind, status, config_json, log_path, output_path, owner_pid, \
             created_at) VALUES (?1, ?2, 'queued', ?3, ?4, ?5, ?6, ?7)",
            params![
                id,
                kind,
                config.to_string(),
                log_path,
                output_path,
                self.pid,
                now() as i64
            ],
        )?;
        Ok(())
    }

    /// One job.
    pub fn get(&self, id: &str) -> rusqlite::Result<Option<JobRow>> {
        self.conn
            .query_row(
                &format!("SELECT {COLUMNS} FROM jobs WHERE id = ?1"),
                [id],
                row,
            )
            .optional()
    }

    /// Every job, newest first.
    pub fn list(&self, limit: usize) -> rusqlite::Result<Vec<JobRow>> {
        let mut q = self.conn.prepare(&format!(
            "SELECT {COLUMNS} FROM jobs ORDER BY created_at DESC, rowid DESC LIMIT ?1"
        ))?;
        let rows = q.query_map([limit as i64], row)?;
        rows.collect()
    }

    /// The oldest queued job of this process.
    pub fn next_queued(&self) -> rusqlite::Result<Option<JobRow>> {
        self.conn
            .query_row(
                &format!(
                    "SELECT {COLUMNS} FROM jobs WHERE status = 'queued' AND owner_pid = ?1 \
                     ORDER BY created_at, rowid LIMIT 1"
                ),
                [self.pid],
                row,
            )
            .optional()
    }

    /// Marks a queued job running.
    pub fn start(&self, id: &str) -> rusqlite::Result<bool> {
        let n = self.conn.execute(
            "UPDATE jobs SET status = 'running', started_at = ?2 WHERE id = ?1 AND status = 'queued'",
            params![id, now() as i64],
        )?;
        Ok(n == 1)
    }

    /// Records progress and the latest message.
    pub fn progress(&self, id: &str, progress: Option<f64>, message: &str) -> rusqlite::Result<()> {
        self.conn.execute(
            "UPDATE jobs SET progress = COALESCE(?2, progress), message = ?3 WHERE id = ?1",
            params![id, progress, message],
        )?;
        Ok(())
    }

    /// Ends a job (`error` for failed, zombie and cancelled ones); false when it had ended.
    pub fn finish(&self, id: &str, status: Status, error: Option<&str>) -> rusqlite::Result<bool> {
        let n = self.conn.execute(
            "UPDATE jobs SET status = ?2, error = ?3, ended_at = ?4, \
             progress = CASE WHEN ?2 = 'done' THEN 1.0 ELSE progress END \
             WHERE id = ?1 AND status IN ('queued', 'running')",
            params![id, status.name(), error, now() as i64],
        )?;
        Ok(n == 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn rows_survive_a_reopen_and_unfinished_ones_of_a_gone_server_become_zombies() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("jobs.sqlite");
        {
            let (db, marked) = JobDb::open(&path).unwrap();
            assert_eq!(marked, 0);
            db.insert(
                "job-a",
                "finetune",
                &json!({"iters": 3}),
                "/x/a.ndjson",
                Some("/out/a"),
            )
            .unwrap();
            db.insert("job-b", "finetune", &json!({}), "/x/b.ndjson", None)
                .unwrap();
            db.insert("job-c", "finetune", &json!({}), "/x/c.ndjson", None)
                .unwrap();
            assert_eq!(db.next_queued().unwrap().unwrap().id, "job-a");
            assert!(db.start("job-a").unwrap());
            db.progress("job-a", Some(0.5), "step 1").unwrap();
            assert!(db.finish("job-b", Status::Done, None).unwrap());
            assert!(!db.finish("job-b", Status::Failed, Some("late")).unwrap());
            // Another server's unfinished job, still alive: left alone below.
            db.conn
                .execute("UPDATE jobs SET owner_pid = 1 WHERE id = 'job-c'", [])
                .unwrap();
        }
        let (db, marked) = JobDb::open(&path).unwrap();
        assert_eq!(marked, 1, "only our own running job is orphaned");
        let a = db.get("job-a").unwrap().unwrap();
        assert_eq!(a.status, Status::Zombie);
        assert_eq!(a.progress, 0.5);
        assert_eq!(a.config, json!({"iters": 3}));
        assert_eq!(a.output_path.as_deref(), Some("/out/a"));
        assert!(a.error.unwrap().contains("stopped"));
        assert_eq!(db.get("job-b").unwrap().unwrap().status, Status::Done);
        assert_eq!(db.get("job-b").unwrap().unwrap().progress, 1.0);
        assert_eq!(db.get("job-c").unwrap().unwrap().status, Status::Queued);
        assert!(db.get("job-z").unwrap().is_none());
        let ids: Vec<String> = db.list(10).unwrap().into_iter().map(|r| r.id).collect();
        assert_eq!(ids, ["job-c", "job-b", "job-a"]);
        // Not ours: never picked up by this server's runner.
        assert!(db.next_queued().unwrap().is_none());
    }
}
