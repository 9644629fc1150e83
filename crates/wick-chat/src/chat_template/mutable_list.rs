//! Lists held in a `namespace(...)` that templates change in place with `append`/`pop`.
//!
//! Kimi-K2's templates queue tool-call ids with `namespace(ids=[])`, `ns.ids.append(id)` and
//! `ns.ids.pop(0)`. jinja2's sandbox refuses those calls; llama.cpp's engine allows them, and so do
//! we: every list passed to `namespace()` becomes a [`MutableList`]. Lists anywhere else stay
//! immutable, as in jinja2.

use std::sync::{Arc, Mutex};

use minijinja::value::{from_args, Enumerator, Object, ObjectRepr, Value};
use minijinja::{Error, ErrorKind, State};

/// A list that `append`, `pop`, `insert`, `extend`, `remove` and `clear` change in place.
#[derive(Debug, Default)]
pub(crate) struct MutableList {
    items: Mutex<Vec<Value>>,
}

impl MutableList {
    pub(crate) fn new(items: Vec<Value>) -> MutableList {
        MutableList {
            items: Mutex::new(items),
        }
    }

    fn snapshot(&self) -> Vec<Value> {
        self.lock().clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Value>> {
        // A panic while holding the lock cannot leave the Vec half-changed, so a poisoned lock
        // still guards consistent data.
        self.items
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl Object for MutableList {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Seq
    }

    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        let items = self.lock();
        let idx = key.as_i64()?;
        let idx = if idx < 0 {
            idx + items.len() as i64
        } else {
            idx
        };
        usize::try_from(idx)
            .ok()
            .and_then(|idx| items.get(idx).cloned())
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        Enumerator::Values(self.snapshot())
    }

    fn enumerator_len(self: &Arc<Self>) -> Option<usize> {
        Some(self.lock().len())
    }

    fn call_method(
        self: &Arc<Self>,
        _state: &mut State<'_, '_>,
        method: &str,
        args: &[Value],
    ) -> Result<Value, Error> {
        let mut items = self.lock();
        match method {
            "append" => {
                let (item,): (Value,) = from_args(args)?;
                items.push(item);
                Ok(Value::from(()))
            }
            "extend" => {
                let (more,): (Value,) = from_args(args)?;
                items.extend(more.try_iter()?);
                Ok(Value::from(()))
            }
            "insert" => {
                let (at, item): (i64, Value) = from_args(args)?;
                let len = items.len() as i64;
                let at = if at < 0 {
                    (at + len).max(0)
                } else {
                    at.min(len)
                };
                items.insert(at as usize, item);
                Ok(Value::from(()))
            }
            "pop" => {
                let (at,): (Option<i64>,) = from_args(args)?;
                if items.is_empty() {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "pop from empty list",
                    ));
                }
                let len = items.len() as i64;
                let at = at.unwrap_or(-1);
                let at = if at < 0 { at + len } else { at };
                if !(0..len).contains(&at) {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "pop index out of range",
                    ));
                }
                Ok(items.remove(at as usize))
            }
            "remove" => {
                let (item,): (Value,) = from_args(args)?;
                match items.iter().position(|x| *x == item) {
                    Some(at) => {
                        items.remove(at);
                        Ok(Value::from(()))
                    }
                    None => Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "list.remove(x): x not in list",
                    )),
                }
            }
            "clear" => {
                let () = from_args(args)?;
                items.clear();
                Ok(Value::from(()))
            }
            _ => Err(Error::from(ErrorKind::UnknownMethod)),
        }
    }
}

/// Replaces a plain list by a [`MutableList`] holding the same items; other values pass through.
pub(crate) fn make_mutable(value: Value) -> Value {
    if value.kind() == minijinja::value::ValueKind::Seq
        && value.downcast_object_ref::<MutableList>().is_none()
        && !value.is_tuple()
    {
        match value.try_iter() {
            Ok(items) => Value::from_object(MutableList::new(items.collect())),
            Err(_) => value,
        }
    } else {
        value
    }
}
