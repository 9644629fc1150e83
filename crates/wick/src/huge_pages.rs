//! Transparent huge pages for wick's heap on glibc Linux.
//!
//! A decode step streams every weight and, when batched, tens of megabytes of KV blocks
//! from memory. With 4 KiB pages that is tens of thousands of TLB misses per step, and
//! each one costs a page walk (two-dimensional in a VM). Where the kernel hands out huge
//! pages only on request (`transparent_hugepage/enabled` = `madvise`, the usual default),
//! glibc asks for them on all heap memory when its `glibc.malloc.hugetlb=1` tunable is
//! set. Tunables are read once, when the process starts, so [`enable`] re-executes the
//! binary with the tunable added, before anything else runs.
//!
//! Measured on the 2-core CI-class VM, SmolLM2-135M, `wick bench --case 171:256:1 --case
//! 171:256:8` in fresh processes, alternating with and without (nine pairs over two runs):
//! medians +7–9% for one stream and +9–18% for eight. Through `wick serve` the same comparison
//! (two servers side by side, six alternations) was inside the machine's noise.
//!
//! `WICK_HUGE_PAGES=0` turns it off. Nothing happens elsewhere (other OS or C library,
//! THP `always` or `never`, the tunable already set), and a failed re-execution just
//! continues in the current process.

/// The glibc tunable that makes malloc request transparent huge pages (glibc 2.35+;
/// older versions ignore it).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const TUNABLE: &str = "glibc.malloc.hugetlb";

/// Re-executes the current binary with glibc's huge-page tunable set, if that would
/// change anything; returns when it does not (or the re-execution fails).
///
/// Call it first in `main`, while the process has a single thread.
pub fn enable() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        use std::os::unix::process::CommandExt;

        if std::env::var_os("WICK_HUGE_PAGES").is_some_and(|v| v == "0") {
            return;
        }
        let Some(tunables) = wanted_tunables(
            std::env::var_os("GLIBC_TUNABLES").as_deref(),
            &std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
                .unwrap_or_default(),
        ) else {
            return;
        };
        let Ok(exe) = std::env::current_exe() else {
            return;
        };
        let mut args = std::env::args_os();
        let mut command = std::process::Command::new(exe);
        if let Some(arg0) = args.next() {
            command.arg0(arg0);
        }
        // `exec` returns only when it failed; the process then goes on as it is.
        let _ = command.args(args).env("GLIBC_TUNABLES", tunables).exec();
    }
}

/// The `GLIBC_TUNABLES` value to re-execute with, given the current one and the kernel's
/// THP mode; `None` when huge pages are already asked for, the kernel does not need the
/// request (`always`) or refuses it (`never`), or the current value is not text.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn wanted_tunables(current: Option<&std::ffi::OsStr>, thp_mode: &str) -> Option<String> {
    if !thp_mode.contains("[madvise]") {
        return None;
    }
    let current = current.map_or(Some(""), |v| v.to_str())?;
    if current.contains(TUNABLE) {
        return None;
    }
    Some(if current.is_empty() {
        format!("{TUNABLE}=1")
    } else {
        format!("{current}:{TUNABLE}=1")
    })
}

#[cfg(all(test, target_os = "linux", target_env = "gnu"))]
mod tests {
    use super::*;
    use std::ffi::OsStr;

    const MADVISE: &str = "always [madvise] never\n";

    #[test]
    fn adds_the_tunable_where_the_kernel_wants_a_request() {
        assert_eq!(
            wanted_tunables(None, MADVISE).as_deref(),
            Some("glibc.malloc.hugetlb=1")
        );
        assert_eq!(
            wanted_tunables(Some(OsStr::new("glibc.malloc.arena_max=2")), MADVISE).as_deref(),
            Some("glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1")
        );
    }

    #[test]
    fn leaves_the_process_alone_otherwise() {
        // Already set (by the user, or by the re-execution itself: no loop).
        assert_eq!(
            wanted_tunables(Some(OsStr::new("glibc.malloc.hugetlb=0")), MADVISE),
            None
        );
        assert_eq!(wanted_tunables(None, "[always] madvise never\n"), None);
        assert_eq!(wanted_tunables(None, "always madvise [never]\n"), None);
        // No THP in this kernel.
        assert_eq!(wanted_tunables(None, ""), None);
    }
}
