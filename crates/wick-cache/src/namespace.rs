//! Cache namespaces: KV computed under one adapter set never seeds another.
//!
//! A namespace is a string: `""` for the base model; any other string names weights whose
//! KV must stay apart from the base model's. Generation checkpoints live in namespaces of
//! their own (`__generation_checkpoint__:<key>`), which prefix lookups never search.

/// The prefix of generation-checkpoint namespaces.
pub const CHECKPOINT_PREFIX: &str = "__generation_checkpoint__:";

/// The namespace of the base model (no adapters).
pub const BASE: &str = "";

/// The directory a namespace's files live in: `base` for the base model, the hex xxh3 of
/// the name otherwise (names may hold any character; directory names may not).
pub fn dir_name(ns: &str) -> String {
    if ns.is_empty() {
        "base".to_string()
    } else {
        format!("ns-{:016x}", xxhash_rust::xxh3::xxh3_64(ns.as_bytes()))
    }
}

/// Whether `name` is a directory name [`dir_name`] gives (`base` or `ns-<16 hex digits>`).
pub fn is_dir_name(name: &str) -> bool {
    name == "base"
        || name.strip_prefix("ns-").is_some_and(|h| {
            h.len() == 16
                && h.bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        })
}

/// Whether `ns` is a generation-checkpoint namespace.
pub fn is_checkpoint(ns: &str) -> bool {
    ns.starts_with(CHECKPOINT_PREFIX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert_eq!(dir_name(""), "base");
        assert_ne!(dir_name("a"), dir_name("b"));
        assert!(dir_name("a/../../x").starts_with("ns-"));
        assert!(is_dir_name(&dir_name("")) && is_dir_name(&dir_name("lora")));
        assert!(!is_dir_name("chunks") && !is_dir_name("ns-") && !is_dir_name("ns-../../etc"));
        assert!(is_checkpoint("__generation_checkpoint__:00ff"));
        assert!(!is_checkpoint("lora"));
    }
}
