//! [`DirtyRecords`]: RAM entries that are not yet durable, with their debounce timers.
//!
//! A put marks `(namespace, tokens)` dirty and arms a debounce; the key holds the exact
//! tokens, so two conversations of the same length never cancel each other. A record
//! becomes due when its debounce ends; while the engine is busy it is deferred (unless
//! it has waited past the longest deferral). A record is cleared once the SSD holds an
//! entry covering it, whoever wrote that entry (write-behind, a spill, a longer entry).
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Timing of write-behind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timing {
    /// Quiet time after the last put of a key before it is snapshotted.
    pub debounce: Duration,
    /// Re-check interval while the engine is busy (or after a failed attempt).
    pub retry: Duration,
    /// The longest a due record waits for the engine to go idle.
    pub max_defer: Duration,
}

impl Default for Timing {
    fn default() -> Self {
        Timing {
            debounce: Duration::from_millis(1000),
            retry: Duration::from_millis(5000),
            max_defer: Duration::from_secs(60),
        }
    }
}

/// Identifies a dirty record.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct DirtyKey {
    /// Namespace.
    pub ns: Arc<str>,
    /// Exact tokens.
    pub tokens: Arc<[u32]>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Waiting for its debounce or retry.
    Armed,
    /// Not in RAM and not yet covered on disk: waits for a spill or a flush.
    Missing,
}

#[derive(Debug)]
struct Record {
    due: Instant,
    since: Instant,
    state: State,
}

/// What the writer should do next.
#[derive(Debug, PartialEq, Eq)]
pub enum Next {
    /// Snapshot this record now.
    Due(DirtyKey),
    /// Nothing due; wake after this long (`None`: only when told).
    Wait(Option<Duration>),
}

/// The dirty set.
#[derive(Debug, Default)]
pub struct DirtyRecords {
    records: HashMap<DirtyKey, Record>,
}

impl DirtyRecords {
    /// Marks a key dirty (again), restarting its debounce.
    pub fn schedule(&mut self, key: DirtyKey, now: Instant, t: &Timing) {
        let r = self.records.entry(key).or_insert(Record {
            due: now,
            since: now,
            state: State::Armed,
        });
        r.due = now + t.debounce;
        r.state = State::Armed;
    }

    /// The next due record, deferring due ones while `busy`.
    pub fn next(&mut self, now: Instant, busy: bool, t: &Timing) -> Next {
        let mut wait: Option<Duration> = None;
        let mut due: Option<(&DirtyKey, &mut Record)> = None;
        for (k, r) in self.records.iter_mut() {
            if r.state != State::Armed {
                continue;
            }
            if r.due <= now {
                if busy && now.duration_since(r.since) < t.max_defer {
                    r.due = now + t.retry;
                } else if due.as_ref().is_none_or(|(_, d)| r.since < d.since) {
                    due = Some((k, r));
                    continue;
                }
            }
            let left = r.due.saturating_duration_since(now);
            wait = Some(wait.map_or(left, |w| w.min(left)));
        }
        match due {
            Some((k, r)) => {
                // Armed again in case the attempt cannot finish; cleared on success.
                r.due = now + t.retry;
                Next::Due(k.clone())
            }
            None => Next::Wait(wait),
        }
    }

    /// An attempt failed: retry later.
    pub fn failed(&mut self, key: &DirtyKey, now: Instant, t: &Timing) {
        if let Some(r) = self.records.get_mut(key) {
            r.due = now + t.retry;
            r.state = State::Armed;
        }
    }

    /// The entry left RAM uncovered; it waits for a spill or a flush.
    pub fn missing(&mut self, key: &DirtyKey) {
        if let Some(r) = self.records.get_mut(key) {
            r.state = State::Missing;
        }
    }

    /// Forgets a record.
    pub fn clear(&mut self, key: &DirtyKey) {
        self.records.remove(key);
    }

    /// Clears every record of `ns` that an entry holding `tokens` covers: the record's
    /// tokens are a prefix of them and at least `floor` long (the entry can be cut back).
    pub fn clear_covered(&mut self, ns: &str, tokens: &[u32], floor: usize) -> usize {
        let before = self.records.len();
        self.records.retain(|k, _| {
            let covered = &*k.ns == ns
                && k.tokens.len() <= tokens.len()
                && (k.tokens.len() == tokens.len() || k.tokens.len() >= floor)
                && tokens[..k.tokens.len()] == *k.tokens;
            !covered
        });
        before - self.records.len()
    }

    /// Every dirty key, oldest first.
    pub fn keys(&self) -> Vec<DirtyKey> {
        let mut v: Vec<(&DirtyKey, &Record)> = self.records.iter().collect();
        v.sort_by_key(|(_, r)| r.since);
        v.into_iter().map(|(k, _)| k.clone()).collect()
    }

    /// Records not yet durable.
    pub fn len(&self) -> usize {
        self.records.len()
    }

    /// Whether everything is durable.
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(t: &[u32]) -> DirtyKey {
        DirtyKey {
            ns: "".into(),
            tokens: t.into(),
        }
    }

    #[test]
    fn debounce_and_busy_deferral() {
        let t = Timing::default();
        let mut d = DirtyRecords::default();
        let t0 = Instant::now();
        d.schedule(key(&[1]), t0, &t);
        assert_eq!(d.next(t0, false, &t), Next::Wait(Some(t.debounce)));
        // A second put of the same key restarts the debounce.
        d.schedule(key(&[1]), t0 + Duration::from_millis(500), &t);
        assert!(matches!(
            d.next(t0 + t.debounce, false, &t),
            Next::Wait(Some(_))
        ));
        let due_at = t0 + Duration::from_millis(1500);
        // Busy: deferred by the retry interval.
        assert_eq!(d.next(due_at, true, &t), Next::Wait(Some(t.retry)));
        assert_eq!(d.next(due_at + t.retry, false, &t), Next::Due(key(&[1])));
        // Busy for longer than the deferral limit: due anyway.
        let late = t0 + t.max_defer + Duration::from_secs(10);
        assert_eq!(d.next(late, true, &t), Next::Due(key(&[1])));
    }

    #[test]
    fn same_length_keys_stay_apart_and_coverage_clears() {
        let t = Timing::default();
        let mut d = DirtyRecords::default();
        let now = Instant::now();
        d.schedule(key(&[1, 2]), now, &t);
        d.schedule(key(&[1, 3]), now, &t);
        d.schedule(key(&[1, 2, 3, 4]), now, &t);
        assert_eq!(d.len(), 3);
        // An untrimmable entry of [1,2,3,4,5] (floor 5) covers nothing shorter.
        assert_eq!(d.clear_covered("", &[1, 2, 3, 4, 5], 5), 0);
        assert_eq!(d.clear_covered("x", &[1, 2, 3, 4], 0), 0);
        assert_eq!(d.clear_covered("", &[1, 2, 3, 4], 0), 2);
        assert_eq!(d.keys(), vec![key(&[1, 3])]);
        d.missing(&key(&[1, 3]));
        assert_eq!(d.next(now + t.max_defer * 2, false, &t), Next::Wait(None));
    }
}
