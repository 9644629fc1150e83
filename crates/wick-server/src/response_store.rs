//! [`ResponseStore`]: stored Responses-API responses, in memory, for `previous_response_id`
//! and `GET` / `DELETE /v1/responses/{id}`. Entries expire after a TTL and the oldest are
//! dropped when the byte cap is reached, so a client cannot grow it without bound.
use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::Value;

/// How long a stored response lives.
pub const RESPONSE_TTL: Duration = Duration::from_secs(6 * 60 * 60);

/// Bytes of stored responses kept at most (JSON text size).
pub const RESPONSE_STORE_BYTES: usize = 256 << 20;

/// One stored response.
#[derive(Debug, Clone)]
pub struct StoredResponse {
    /// The response object, as `GET` answers it.
    pub response: Value,
    /// The conversation up to and including this response's output, as chat messages
    /// (without the turn's instructions), which a follow-up continues.
    pub conversation: Vec<Value>,
}

#[derive(Debug)]
struct Entry {
    stored: StoredResponse,
    bytes: usize,
    at: Instant,
}

#[derive(Debug, Default)]
struct Inner {
    entries: HashMap<String, Entry>,
    order: VecDeque<String>,
    bytes: usize,
}

/// The store; cheap to share behind an `Arc`.
#[derive(Debug)]
pub struct ResponseStore {
    inner: Mutex<Inner>,
    ttl: Duration,
    cap: usize,
}

impl Default for ResponseStore {
    fn default() -> Self {
        ResponseStore::new(RESPONSE_TTL, RESPONSE_STORE_BYTES)
    }
}

impl ResponseStore {
    /// A store keeping entries for `ttl`, `cap` bytes at most.
    pub fn new(ttl: Duration, cap: usize) -> Self {
        ResponseStore {
            inner: Mutex::new(Inner::default()),
            ttl,
            cap,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Stores `stored` under `id`; one larger than the cap is not kept.
    pub fn insert(&self, id: String, stored: StoredResponse) {
        let bytes = stored.response.to_string().len()
            + stored
                .conversation
                .iter()
                .map(|m| m.to_string().len())
                .sum::<usize>();
        if bytes > self.cap {
            tracing::warn!(%id, bytes, "response larger than the store: not stored");
            return;
        }
        let mut inner = self.lock();
        self.expire(&mut inner);
        while inner.bytes + bytes > self.cap {
            let Some(oldest) = inner.order.pop_front() else {
                break;
            };
            if let Some(e) = inner.entries.remove(&oldest) {
                inner.bytes -= e.bytes;
            }
        }
        inner.bytes += bytes;
        inner.order.push_back(id.clone());
        let entry = Entry {
            stored,
            bytes,
            at: Instant::now(),
        };
        if let Some(old) = inner.entries.insert(id, entry) {
            inner.bytes -= old.bytes;
        }
    }

    /// The response stored under `id`, if it has not expired.
    pub fn get(&self, id: &str) -> Option<StoredResponse> {
        let mut inner = self.lock();
        self.expire(&mut inner);
        inner.entries.get(id).map(|e| e.stored.clone())
    }

    /// Removes `id`; whether it was there.
    pub fn remove(&self, id: &str) -> bool {
        let mut inner = self.lock();
        match inner.entries.remove(id) {
            Some(e) => {
                inner.bytes -= e.bytes;
                inner.order.retain(|k| k != id);
                true
            }
            None => false,
        }
    }

    fn expire(&self, inner: &mut Inner) {
        while let Some(oldest) = inner.order.front() {
            let expired = inner
                .entries
                .get(oldest)
                .is_none_or(|e| e.at.elapsed() > self.ttl);
            if !expired {
                break;
            }
            if let Some(id) = inner.order.pop_front() {
                if let Some(e) = inner.entries.remove(&id) {
                    inner.bytes -= e.bytes;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn stored(text: &str) -> StoredResponse {
        StoredResponse {
            response: json!({"t": text}),
            conversation: vec![json!({"role": "user", "content": text})],
        }
    }

    #[test]
    fn the_byte_cap_drops_the_oldest_and_delete_removes() {
        let one = stored("aaaaaaaaaa");
        let size = one.response.to_string().len() + one.conversation[0].to_string().len();
        let store = ResponseStore::new(RESPONSE_TTL, size * 2);
        store.insert("a".into(), one.clone());
        store.insert("b".into(), one.clone());
        store.insert("c".into(), one);
        assert!(store.get("a").is_none());
        assert!(store.get("b").is_some() && store.get("c").is_some());
        assert!(store.remove("b"));
        assert!(!store.remove("b"));
        assert!(store.get("b").is_none());
    }

    #[test]
    fn entries_expire() {
        let store = ResponseStore::new(Duration::ZERO, 1 << 20);
        store.insert("a".into(), stored("x"));
        std::thread::sleep(Duration::from_millis(2));
        assert!(store.get("a").is_none());
    }
}
