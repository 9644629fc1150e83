//! Per-op wall-time accounting of the candle backend, on when `WICK_PROFILE` is set.
//!
//! Each backend op opens an [`OpTimer`]; times add up per (op, phase) on the thread that
//! ran them — phase "decode" when the op saw one row, "prefill" otherwise — and the
//! table is printed to stderr when that thread ends (for the main thread: at exit).
use std::cell::RefCell;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("WICK_PROFILE").is_some_and(|v| v != "0"))
}

#[derive(Default)]
struct Table {
    rows: Vec<(&'static str, bool, Duration, u64)>,
}

impl Drop for Table {
    fn drop(&mut self) {
        if self.rows.is_empty() {
            return;
        }
        for decode in [false, true] {
            let phase: Vec<_> = self.rows.iter().filter(|r| r.1 == decode).collect();
            let total: Duration = phase.iter().map(|r| r.2).sum();
            if phase.is_empty() {
                continue;
            }
            let name = if decode { "decode" } else { "prefill" };
            eprintln!(
                "wick profile ({name}): {:.1} ms in backend ops",
                total.as_secs_f64() * 1e3
            );
            let mut phase = phase;
            phase.sort_by_key(|r| std::cmp::Reverse(r.2));
            for (op, _, t, n) in phase {
                eprintln!(
                    "  {op:<12} {:>9.2} ms {:>5.1}%  {n:>7} calls {:>8.1} us/call",
                    t.as_secs_f64() * 1e3,
                    100.0 * t.as_secs_f64() / total.as_secs_f64().max(1e-12),
                    t.as_secs_f64() * 1e6 / *n as f64
                );
            }
        }
    }
}

thread_local! {
    static TABLE: RefCell<Table> = RefCell::new(Table::default());
}

/// Times one op until dropped.
pub(crate) struct OpTimer {
    op: &'static str,
    decode: bool,
    start: Option<Instant>,
}

/// Starts timing `op` over `rows` activation rows (no-op unless profiling).
pub(crate) fn op(op: &'static str, rows: usize) -> OpTimer {
    OpTimer {
        op,
        decode: rows == 1,
        start: enabled().then(Instant::now),
    }
}

impl Drop for OpTimer {
    fn drop(&mut self) {
        let Some(start) = self.start else { return };
        let dt = start.elapsed();
        let _ = TABLE.try_with(|t| {
            let mut t = t.borrow_mut();
            match t
                .rows
                .iter_mut()
                .find(|r| r.0 == self.op && r.1 == self.decode)
            {
                Some(r) => {
                    r.2 += dt;
                    r.3 += 1;
                }
                None => t.rows.push((self.op, self.decode, dt, 1)),
            }
        });
    }
}
