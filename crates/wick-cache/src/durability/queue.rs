//! [`WriteQueue`]: the byte-capped FIFO of disk jobs in front of the SSD writer.
//!
//! Over the cap, the oldest droppable job goes first; a job being pushed is never its
//! own victim, and jobs a flush is waiting for or that remove checkpoints are never
//! dropped. Jobs are numbered in push order; since one writer takes them in that order,
//! "every job up to N is resolved" is a simple check.
use std::collections::VecDeque;
use std::sync::Arc;

use crate::checkpoint::{CheckpointKey, CheckpointMeta};
use crate::value::KvSnapshot;

/// What a job does.
pub enum JobKind<V> {
    /// Write an entry evicted from RAM.
    Spill {
        /// Namespace.
        ns: Arc<str>,
        /// Tokens.
        tokens: Arc<[u32]>,
        /// The KV.
        value: V,
    },
    /// Write a host copy of an entry still in RAM (a flush).
    Snapshot {
        /// Namespace.
        ns: Arc<str>,
        /// Tokens.
        tokens: Arc<[u32]>,
        /// The host copy.
        host: KvSnapshot,
    },
    /// Write a generation checkpoint (older ones of the key go after the rename).
    Checkpoint {
        /// The generation.
        key: CheckpointKey,
        /// The record.
        meta: CheckpointMeta,
        /// Tokens the KV holds.
        tokens: Arc<[u32]>,
        /// The host copy.
        host: KvSnapshot,
    },
    /// Remove every checkpoint of a finished generation.
    RemoveCheckpoints {
        /// The generation.
        key: CheckpointKey,
    },
}

/// A queued job.
pub struct Job<V> {
    /// Push order.
    pub seq: u64,
    /// Bytes it holds (counted against the cap).
    pub bytes: usize,
    /// Whether the cap may drop it.
    pub droppable: bool,
    /// What to do.
    pub kind: JobKind<V>,
}

/// The queue.
pub struct WriteQueue<V> {
    jobs: VecDeque<Job<V>>,
    bytes: usize,
    max_bytes: usize,
    next_seq: u64,
}

impl<V> WriteQueue<V> {
    /// An empty queue holding at most `max_bytes` of droppable jobs.
    pub fn new(max_bytes: usize) -> Self {
        WriteQueue {
            jobs: VecDeque::new(),
            bytes: 0,
            max_bytes,
            next_seq: 1,
        }
    }

    /// Appends a job; returns its number and the jobs dropped to make room.
    pub fn push(&mut self, kind: JobKind<V>, bytes: usize, droppable: bool) -> (u64, Vec<Job<V>>) {
        let mut dropped = Vec::new();
        while self.bytes + bytes > self.max_bytes {
            let Some(i) = self.jobs.iter().position(|j| j.droppable) else {
                break;
            };
            if let Some(j) = self.jobs.remove(i) {
                self.bytes -= j.bytes;
                dropped.push(j);
            }
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        self.bytes += bytes;
        self.jobs.push_back(Job {
            seq,
            bytes,
            droppable,
            kind,
        });
        (seq, dropped)
    }

    /// Takes the oldest job.
    pub fn pop(&mut self) -> Option<Job<V>> {
        let j = self.jobs.pop_front()?;
        self.bytes -= j.bytes;
        Some(j)
    }

    /// The number the next push gets.
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    /// The lowest job number still queued.
    pub fn first_seq(&self) -> Option<u64> {
        self.jobs.front().map(|j| j.seq)
    }

    /// Jobs queued.
    pub fn len(&self) -> usize {
        self.jobs.len()
    }

    /// Whether nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.jobs.is_empty()
    }

    /// Bytes queued.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Jobs queued by kind: (spills, snapshots, checkpoints).
    pub fn counts(&self) -> (usize, usize, usize) {
        let mut c = (0, 0, 0);
        for j in &self.jobs {
            match j.kind {
                JobKind::Spill { .. } => c.0 += 1,
                JobKind::Snapshot { .. } => c.1 += 1,
                JobKind::Checkpoint { .. } => c.2 += 1,
                JobKind::RemoveCheckpoints { .. } => {}
            }
        }
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spill(n: u32) -> JobKind<u32> {
        JobKind::Spill {
            ns: "".into(),
            tokens: vec![n].into(),
            value: n,
        }
    }

    #[test]
    fn drops_the_oldest_droppable_never_the_newest() {
        let mut q = WriteQueue::new(100);
        let (a, d) = q.push(spill(1), 60, true);
        assert!(d.is_empty());
        let (_, d) = q.push(spill(2), 30, false);
        assert!(d.is_empty());
        let (c, d) = q.push(spill(3), 50, true);
        assert_eq!(d.iter().map(|j| j.seq).collect::<Vec<_>>(), vec![a]);
        assert_eq!(q.bytes(), 80);
        // Bigger than the cap alone: everything droppable goes, the newcomer stays.
        let (e, d) = q.push(spill(4), 500, true);
        assert_eq!(d.iter().map(|j| j.seq).collect::<Vec<_>>(), vec![c]);
        assert_eq!(q.len(), 2);
        assert_eq!(q.pop().unwrap().bytes, 30);
        assert_eq!(q.pop().unwrap().seq, e);
        assert!(q.pop().is_none());
        assert_eq!(q.bytes(), 0);
    }
}
