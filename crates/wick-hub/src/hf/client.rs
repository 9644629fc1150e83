//! The Hugging Face Hub's HTTP file API: who to ask (`HF_ENDPOINT`), with which token
//! (`HF_TOKEN`, else the token file `huggingface-cli login` writes), and the three calls a
//! download needs: the revision's commit, the file tree, and the file bytes.
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;
use ureq::Agent;

use super::error::GetError;

/// The Hub's address when `HF_ENDPOINT` is not set.
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// How long a connection may go without delivering a byte before it counts as cut.
const READ_STALL: Duration = Duration::from_secs(60);

/// A client of one Hub endpoint.
#[derive(Clone)]
pub struct HubClient {
    endpoint: String,
    token: Option<String>,
    agent: Agent,
    /// Does not follow redirects: the file metadata is on the first answer.
    head_agent: Agent,
}

impl std::fmt::Debug for HubClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HubClient")
            .field("endpoint", &self.endpoint)
            .field("token", &self.token.as_ref().map(|_| "<set>"))
            .finish()
    }
}

/// One file of a revision, as the tree listing (or a HEAD request) describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteFile {
    /// Path inside the repository (`/`-separated).
    pub path: String,
    /// Size in bytes.
    pub size: u64,
    /// The blob's name in the cache: the LFS sha256, or the git blob sha1.
    pub etag: String,
    /// How the bytes are verified.
    pub check: Check,
}

/// The digest a downloaded blob must have before it is published.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Check {
    /// An LFS file: sha256 of the content (hex).
    Sha256(String),
    /// A regular git file: sha1 of `blob <len>\0<content>` (hex).
    GitBlobSha1(String),
    /// The server gave no digest wick can check (an etag of another shape).
    Unverifiable,
}

impl Check {
    /// The check an etag implies: 64 hex digits are an LFS sha256, 40 a git blob sha1.
    pub fn from_etag(etag: &str) -> Check {
        let hex = etag.bytes().all(|b| b.is_ascii_hexdigit());
        match etag.len() {
            64 if hex => Check::Sha256(etag.to_ascii_lowercase()),
            40 if hex => Check::GitBlobSha1(etag.to_ascii_lowercase()),
            _ => Check::Unverifiable,
        }
    }
}

#[derive(Deserialize)]
struct RevisionInfo {
    sha: Option<String>,
    #[serde(default)]
    siblings: Vec<Sibling>,
}

#[derive(Deserialize)]
struct Sibling {
    rfilename: String,
}

#[derive(Deserialize)]
struct TreeEntry {
    #[serde(rename = "type")]
    kind: String,
    path: String,
    #[serde(default)]
    size: u64,
    #[serde(default)]
    oid: Option<String>,
    #[serde(default)]
    lfs: Option<LfsInfo>,
}

#[derive(Deserialize)]
struct LfsInfo {
    oid: String,
    size: u64,
}

/// `%`-encodes everything but unreserved characters (RFC 3986), so a revision such as
/// `refs/pr/1` stays one path segment.
pub(crate) fn encode_segment(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// A repository file path with each segment encoded.
fn encode_path(path: &str) -> String {
    path.split('/')
        .map(encode_segment)
        .collect::<Vec<_>>()
        .join("/")
}

/// An etag header without its weak marker and quotes.
fn clean_etag(value: &str) -> String {
    value
        .trim()
        .trim_start_matches("W/")
        .trim_matches('"')
        .to_string()
}

/// The `rel="next"` target of a `Link` header (the tree listing's pagination).
fn next_link(link: &str) -> Option<String> {
    link.split(',').find_map(|part| {
        let (url, params) = part.split_once(';')?;
        params.contains("rel=\"next\"").then(|| {
            url.trim()
                .trim_start_matches('<')
                .trim_end_matches('>')
                .to_string()
        })
    })
}

/// The token `huggingface_hub` would use: `HF_TOKEN`, else the file at `HF_TOKEN_PATH`,
/// `$HF_HOME/token` or `~/.cache/huggingface/token`.
pub fn token_from_env(var: impl Fn(&str) -> Option<String>) -> Option<String> {
    let set = |k: &str| var(k).filter(|v| !v.trim().is_empty());
    if let Some(token) = set("HF_TOKEN") {
        return Some(token.trim().to_string());
    }
    let file = set("HF_TOKEN_PATH")
        .map(PathBuf::from)
        .or_else(|| set("HF_HOME").map(|h| PathBuf::from(h).join("token")))
        .or_else(|| set("XDG_CACHE_HOME").map(|c| PathBuf::from(c).join("huggingface/token")))
        .or_else(|| set("HOME").map(|h| PathBuf::from(h).join(".cache/huggingface/token")))?;
    let token = std::fs::read_to_string(file).ok()?;
    let token = token.trim();
    (!token.is_empty()).then(|| token.to_string())
}

impl HubClient {
    /// A client of `endpoint` (no trailing slash needed) sending `token` when given.
    pub fn new(endpoint: &str, token: Option<String>) -> HubClient {
        let build = |redirects: u32| -> Agent {
            Agent::config_builder()
                .http_status_as_error(false)
                .timeout_connect(Some(Duration::from_secs(20)))
                .timeout_recv_response(Some(Duration::from_secs(60)))
                .timeout_per_read(Some(READ_STALL))
                .max_redirects(redirects)
                .max_redirects_will_error(false)
                .user_agent(concat!("wick/", env!("CARGO_PKG_VERSION")))
                .build()
                .into()
        };
        HubClient {
            endpoint: endpoint.trim_end_matches('/').to_string(),
            token,
            agent: build(10),
            head_agent: build(0),
        }
    }

    /// The client the environment configures: `HF_ENDPOINT` and the token (see
    /// [`token_from_env`]).
    pub fn from_env() -> HubClient {
        let var = |k: &str| std::env::var(k).ok();
        let endpoint = var("HF_ENDPOINT")
            .filter(|e| !e.trim().is_empty())
            .unwrap_or_else(|| DEFAULT_ENDPOINT.to_string());
        HubClient::new(&endpoint, token_from_env(var))
    }

    /// The endpoint this client talks to.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Whether a token is sent.
    pub fn has_token(&self) -> bool {
        self.token.is_some()
    }

    fn request(
        &self,
        agent: &Agent,
        method: &str,
        url: &str,
    ) -> ureq::RequestBuilder<ureq::typestate::WithoutBody> {
        let req = match method {
            "HEAD" => agent.head(url),
            _ => agent.get(url),
        };
        match &self.token {
            Some(t) => req.header("Authorization", format!("Bearer {t}")),
            None => req,
        }
    }

    /// A GET of `url` (optionally from byte `from`), the response whatever its status.
    pub(crate) fn get(
        &self,
        url: &str,
        from: u64,
    ) -> Result<ureq::http::Response<ureq::Body>, GetError> {
        let mut req = self.request(&self.agent, "GET", url);
        if from > 0 {
            req = req.header("Range", format!("bytes={from}-"));
        }
        req.call().map_err(|e| GetError::network(url, e))
    }

    /// A status that is not success, turned into the error a user can act on.
    pub(crate) fn status_error(&self, repo: &str, url: &str, status: u16) -> GetError {
        match status {
            401 | 403 => GetError::Unauthorized {
                repo: repo.to_string(),
                status,
                had_token: self.token.is_some(),
            },
            404 => GetError::NotFound {
                url: url.to_string(),
            },
            _ => GetError::Status {
                url: url.to_string(),
                status,
            },
        }
    }

    fn get_json<T: serde::de::DeserializeOwned>(
        &self,
        repo: &str,
        url: &str,
    ) -> Result<(T, Option<String>), GetError> {
        let mut last = None;
        for attempt in 0..super::RETRIES {
            if attempt > 0 {
                std::thread::sleep(super::backoff(attempt));
            }
            let resp = match self.get(url, 0) {
                Ok(r) => r,
                Err(e) => {
                    last = Some(e);
                    continue;
                }
            };
            let status = resp.status().as_u16();
            if status >= 500 || status == 429 {
                last = Some(GetError::Status {
                    url: url.to_string(),
                    status,
                });
                continue;
            }
            if !(200..300).contains(&status) {
                return Err(self.status_error(repo, url, status));
            }
            let link = resp
                .headers()
                .get("link")
                .and_then(|v| v.to_str().ok())
                .and_then(next_link);
            let value = resp
                .into_body()
                .with_config()
                .limit(256 << 20)
                .read_json::<T>()
                .map_err(|e| GetError::BadListing {
                    url: url.to_string(),
                    detail: e.to_string(),
                })?;
            return Ok((value, link));
        }
        Err(last.unwrap_or_else(|| GetError::Status {
            url: url.to_string(),
            status: 0,
        }))
    }

    /// The commit `revision` names, and the files of that commit (siblings).
    pub fn revision(&self, repo: &str, revision: &str) -> Result<(String, Vec<String>), GetError> {
        let url = format!(
            "{}/api/models/{repo}/revision/{}",
            self.endpoint,
            encode_segment(revision)
        );
        let (info, _) = self.get_json::<RevisionInfo>(repo, &url)?;
        let sha = info
            .sha
            .filter(|s| !s.is_empty())
            .ok_or(GetError::BadListing {
                url,
                detail: "no commit sha".into(),
            })?;
        Ok((
            sha,
            info.siblings.into_iter().map(|s| s.rfilename).collect(),
        ))
    }

    /// Every file of `commit` with its size and blob ids, from the tree listing; `None`
    /// when the server has no tree endpoint.
    pub fn tree(&self, repo: &str, commit: &str) -> Result<Option<Vec<RemoteFile>>, GetError> {
        let mut url = format!(
            "{}/api/models/{repo}/tree/{}?recursive=true",
            self.endpoint,
            encode_segment(commit)
        );
        let mut files = Vec::new();
        loop {
            let (entries, next) = match self.get_json::<Vec<TreeEntry>>(repo, &url) {
                Ok(page) => page,
                Err(GetError::NotFound { .. }) if files.is_empty() => return Ok(None),
                Err(e) => return Err(e),
            };
            for e in entries.into_iter().filter(|e| e.kind == "file") {
                let (etag, size, check) = match (e.lfs, e.oid) {
                    (Some(lfs), _) => {
                        let oid = lfs.oid.to_ascii_lowercase();
                        (oid.clone(), lfs.size, Check::Sha256(oid))
                    }
                    (None, Some(oid)) => {
                        let oid = oid.to_ascii_lowercase();
                        (oid.clone(), e.size, Check::from_etag(&oid))
                    }
                    (None, None) => continue,
                };
                files.push(RemoteFile {
                    path: e.path,
                    size,
                    etag,
                    check,
                });
            }
            match next {
                // Only follow pagination on the same server.
                Some(n) if n.starts_with(&self.endpoint) => url = n,
                Some(n) if n.starts_with('/') => url = format!("{}{n}", self.endpoint),
                _ => break,
            }
        }
        Ok(Some(files))
    }

    /// A file's metadata from a HEAD of its resolve URL (what `huggingface_hub` reads:
    /// `X-Linked-Etag`/`ETag`, `X-Linked-Size`/`Content-Length`).
    pub fn head(&self, repo: &str, commit: &str, path: &str) -> Result<RemoteFile, GetError> {
        let url = self.resolve_url(repo, commit, path);
        let resp = self
            .request(&self.head_agent, "HEAD", &url)
            .header("Accept-Encoding", "identity")
            .call()
            .map_err(|e| GetError::network(&url, e))?;
        let status = resp.status().as_u16();
        if !(200..400).contains(&status) {
            return Err(self.status_error(repo, &url, status));
        }
        let header = |k: &str| {
            resp.headers()
                .get(k)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        let etag = header("x-linked-etag")
            .or_else(|| header("etag"))
            .map(|e| clean_etag(&e))
            .filter(|e| !e.is_empty() && !e.contains('/') && !e.contains(".."))
            .ok_or_else(|| GetError::BadListing {
                url: url.clone(),
                detail: "no ETag".into(),
            })?;
        let size = header("x-linked-size")
            .or_else(|| header("content-length"))
            .and_then(|s| s.trim().parse().ok())
            .ok_or_else(|| GetError::BadListing {
                url: url.clone(),
                detail: "no size".into(),
            })?;
        Ok(RemoteFile {
            path: path.to_string(),
            size,
            check: Check::from_etag(&etag),
            etag: etag.to_ascii_lowercase(),
        })
    }

    /// `{endpoint}/{repo}/resolve/{commit}/{path}`.
    pub fn resolve_url(&self, repo: &str, commit: &str, path: &str) -> String {
        format!(
            "{}/{repo}/resolve/{}/{}",
            self.endpoint,
            encode_segment(commit),
            encode_path(path)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn etags_pick_the_check() {
        let sha256 = "a".repeat(64);
        assert_eq!(Check::from_etag(&sha256), Check::Sha256(sha256.clone()));
        let sha1 = "B".repeat(40);
        assert_eq!(Check::from_etag(&sha1), Check::GitBlobSha1("b".repeat(40)));
        assert_eq!(Check::from_etag("xyz"), Check::Unverifiable);
        assert_eq!(clean_etag("W/\"abc\""), "abc");
    }

    #[test]
    fn segments_and_links() {
        assert_eq!(encode_segment("refs/pr/1"), "refs%2Fpr%2F1");
        assert_eq!(encode_path("sub dir/a+b.json"), "sub%20dir/a%2Bb.json");
        assert_eq!(
            next_link("<https://h/api/x?cursor=2>; rel=\"next\""),
            Some("https://h/api/x?cursor=2".into())
        );
        assert_eq!(next_link("<https://h/a>; rel=\"prev\""), None);
    }

    #[test]
    fn token_precedence() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("token"), "file-token\n").unwrap();
        let home = dir.path().to_string_lossy().into_owned();
        let env = |pairs: Vec<(&'static str, String)>| {
            move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone())
        };
        assert_eq!(
            token_from_env(env(vec![
                ("HF_TOKEN", "t1".into()),
                ("HF_HOME", home.clone())
            ])),
            Some("t1".into())
        );
        assert_eq!(
            token_from_env(env(vec![("HF_HOME", home.clone())])),
            Some("file-token".into())
        );
        assert_eq!(
            token_from_env(env(vec![("HOME", "/nonexistent".into())])),
            None
        );
    }
}
