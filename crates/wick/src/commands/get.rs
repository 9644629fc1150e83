//! `wick get ORG/NAME[@REV]`: fetch a repository from the Hugging Face Hub into the
//! Hugging Face cache (resumable, verified), with a progress bar per file and overall.
use std::collections::HashMap;
use std::sync::Mutex;

use clap::Args;
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use wick_hub::hf::{self, GetEvent, GetOptions, Got, HubClient, RepoRef};
use wick_hub::Store;

#[derive(Args)]
pub struct GetArgs {
    /// The repository: ORG/NAME, optionally @REVISION (branch, tag or commit).
    repo: String,
    /// Fetch only files matching this glob (repeatable; `*` also matches `/`), e.g.
    /// `--include '*Q4_K_M*'` to choose one quantization of a GGUF repository.
    #[arg(long)]
    include: Vec<String>,
    /// Revision (branch, tag or commit); default main.
    #[arg(long)]
    revision: Option<String>,
    /// Files downloaded at once.
    #[arg(long, default_value_t = 4)]
    parallel: usize,
}

pub fn run(args: GetArgs) -> anyhow::Result<()> {
    let repo = RepoRef::parse(&args.repo)?;
    let opts = GetOptions {
        revision: args.revision,
        include: args.include,
        parallel: args.parallel,
    };
    let got = fetch(&repo, &opts)?;
    eprintln!(
        "wick: {} at {} ({} files, {:.1} MB downloaded)",
        got.repo,
        &got.commit[..got.commit.len().min(12)],
        got.files.len(),
        got.downloaded_bytes as f64 / 1e6
    );
    println!("{}", got.snapshot.display());
    Ok(())
}

/// Fetches `repo` into the store's Hugging Face cache with progress on stderr.
pub fn fetch(repo: &RepoRef, opts: &GetOptions) -> anyhow::Result<Got> {
    let store = Store::from_env()?;
    let client = HubClient::from_env();
    eprintln!("wick: fetching {} from {}", repo.repo, client.endpoint());
    let progress = Progress::new();
    let got = hf::get(&client, store.hf_cache(), repo, opts, &|e: GetEvent| {
        progress.event(e)
    });
    progress.finish();
    Ok(got?)
}

/// indicatif bars: one per file in flight and one overall; plain lines when stderr is
/// not a terminal.
struct Progress {
    multi: MultiProgress,
    tty: bool,
    overall: Mutex<Option<ProgressBar>>,
    files: Mutex<HashMap<String, (ProgressBar, u64)>>,
}

impl Progress {
    fn new() -> Progress {
        let tty = std::io::IsTerminal::is_terminal(&std::io::stderr());
        let target = if tty {
            ProgressDrawTarget::stderr()
        } else {
            ProgressDrawTarget::hidden()
        };
        Progress {
            multi: MultiProgress::with_draw_target(target),
            tty,
            overall: Mutex::new(None),
            files: Mutex::new(HashMap::new()),
        }
    }

    fn style(template: &str) -> ProgressStyle {
        ProgressStyle::with_template(template)
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> ")
    }

    fn event(&self, event: GetEvent) {
        let mut files = self.files.lock().unwrap_or_else(|e| e.into_inner());
        let overall = self.overall.lock().unwrap_or_else(|e| e.into_inner());
        match event {
            GetEvent::Planned {
                files: list,
                missing_bytes,
                ..
            } => {
                let total: u64 = list.iter().map(|(_, s)| s).sum();
                drop(overall);
                let bar = self.multi.add(ProgressBar::new(total));
                bar.set_style(Self::style(
                    "{prefix:>8} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
                ));
                bar.set_prefix("total");
                bar.set_position(total - missing_bytes.min(total));
                *self.overall.lock().unwrap_or_else(|e| e.into_inner()) = Some(bar);
                if !self.tty {
                    eprintln!(
                        "wick: {} files, {:.1} MB to download",
                        list.len(),
                        missing_bytes as f64 / 1e6
                    );
                }
            }
            GetEvent::Started { path, size, from } => {
                let bar = self.multi.insert_from_back(1, ProgressBar::new(size));
                bar.set_style(Self::style("{msg:>40!} [{bar:30}] {bytes}/{total_bytes}"));
                bar.set_message(path.clone());
                bar.set_position(from);
                if let Some((old, _)) = files.insert(path.clone(), (bar, from)) {
                    old.finish_and_clear();
                }
                if !self.tty && from > 0 {
                    eprintln!("wick: resuming {path} at {from} of {size} bytes");
                }
            }
            GetEvent::Progress { path, received } => {
                if let Some((bar, last)) = files.get_mut(&path) {
                    if let Some(o) = overall.as_ref() {
                        o.inc(received.saturating_sub(*last));
                    }
                    *last = received;
                    bar.set_position(received);
                }
            }
            GetEvent::Retrying {
                path,
                attempt,
                error,
            } => {
                // The retry resumes: the overall bar keeps what was received.
                if let Some((bar, _)) = files.remove(&path) {
                    bar.finish_and_clear();
                }
                let line = format!("wick: {path}: {error}; retrying (attempt {attempt})");
                if self.tty {
                    let _ = self.multi.println(line);
                } else {
                    eprintln!("{line}");
                }
            }
            GetEvent::Done { path, cached } => {
                if let Some((bar, _)) = files.remove(&path) {
                    bar.finish_and_clear();
                }
                if !self.tty {
                    eprintln!(
                        "wick: {path} {}",
                        if cached {
                            "already present"
                        } else {
                            "verified"
                        }
                    );
                }
            }
        }
    }

    fn finish(&self) {
        if let Some(bar) = self
            .overall
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            bar.finish_and_clear();
        }
        for (_, (bar, _)) in self.files.lock().unwrap_or_else(|e| e.into_inner()).drain() {
            bar.finish_and_clear();
        }
    }
}
