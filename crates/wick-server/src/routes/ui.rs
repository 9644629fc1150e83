//! The web UI: static files compiled into the binary (`crates/wick-server/ui/`), served at
//! `/` and `/ui/{file}` without authentication (they hold no data; every call the page
//! makes goes through the API's own checks, with the key the page asks for).
//!
//! Every answer carries a strict Content-Security-Policy (scripts and styles only from this
//! origin, no inline code, no frames, calls only to this origin), `nosniff`, no referrer,
//! and an `ETag` so browsers revalidate (`no-cache`) and get a 304 when nothing changed.
use axum::extract::Path;
use axum::http::header::{
    CACHE_CONTROL, CONTENT_SECURITY_POLICY, CONTENT_TYPE, ETAG, IF_NONE_MATCH, REFERRER_POLICY,
    X_CONTENT_TYPE_OPTIONS,
};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};

use crate::error::ApiError;

/// What the UI may load and call: its own files and this server's API, nothing inline,
/// nothing from elsewhere, never framed.
pub const CONTENT_SECURITY_POLICY_VALUE: &str = "default-src 'none'; script-src 'self'; \
style-src 'self'; img-src 'self'; connect-src 'self'; manifest-src 'self'; base-uri 'none'; \
form-action 'none'; frame-ancestors 'none'";

/// One file of the UI.
struct Asset {
    /// Its name under `/ui/`.
    name: &'static str,
    /// Its `Content-Type`.
    content_type: &'static str,
    /// Its bytes.
    body: &'static [u8],
    /// A hash of the bytes, for the `ETag`.
    hash: u64,
}

/// FNV-1a, 64 bits: enough to tell two builds of a file apart, and computable at compile
/// time.
const fn fnv1a(bytes: &[u8]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    let mut i = 0;
    while i < bytes.len() {
        hash ^= bytes[i] as u64;
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
        i += 1;
    }
    hash
}

macro_rules! asset {
    ($name:literal, $type:expr) => {{
        const BODY: &[u8] = include_bytes!(concat!("../../ui/", $name));
        Asset {
            name: $name,
            content_type: $type,
            body: BODY,
            hash: fnv1a(BODY),
        }
    }};
}

const JS: &str = "text/javascript; charset=utf-8";

/// Every file the UI has; `index.html` is also what `/` answers.
static ASSETS: &[Asset] = &[
    asset!("index.html", "text/html; charset=utf-8"),
    asset!("style.css", "text/css; charset=utf-8"),
    asset!("icon.svg", "image/svg+xml"),
    asset!("js/app.js", JS),
    asset!("js/api.js", JS),
    asset!("js/dom.js", JS),
    asset!("js/markdown.js", JS),
    asset!("js/store.js", JS),
    asset!("js/stream.js", JS),
    asset!("js/chat.js", JS),
    asset!("js/format.js", JS),
    asset!("js/status.js", JS),
    asset!("js/finetune.js", JS),
];

fn find(name: &str) -> Option<&'static Asset> {
    ASSETS.iter().find(|a| a.name == name)
}

/// `GET /`: the UI's page.
pub async fn index(headers: HeaderMap) -> Response {
    match find("index.html") {
        Some(asset) => serve(asset, &headers),
        None => StatusCode::NOT_FOUND.into_response(),
    }
}

/// `GET /ui/{file}`: one of the UI's files, else the API's 404.
pub async fn file(Path(name): Path<String>, headers: HeaderMap, uri: Uri) -> Response {
    match find(&name) {
        Some(asset) => serve(asset, &headers),
        None => ApiError::RouteNotFound {
            method: Method::GET.to_string(),
            path: uri.path().to_string(),
        }
        .into_response(),
    }
}

fn serve(asset: &Asset, request: &HeaderMap) -> Response {
    let etag = format!("\"{:016x}\"", asset.hash);
    let unchanged = request
        .get(IF_NONE_MATCH)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.split(',').any(|t| t.trim() == etag || t.trim() == "*"));
    let mut response = if unchanged {
        StatusCode::NOT_MODIFIED.into_response()
    } else {
        asset.body.into_response()
    };
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static(asset.content_type));
    if let Ok(value) = HeaderValue::from_str(&etag) {
        headers.insert(ETAG, value);
    }
    // Revalidate every time: a new binary may carry new files under the same names.
    headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    headers.insert(
        CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CONTENT_SECURITY_POLICY_VALUE),
    );
    headers.insert(X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    headers.insert(REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_file_the_page_names_is_served() {
        let page = std::str::from_utf8(find("index.html").map(|a| a.body).unwrap_or_default())
            .unwrap_or_default();
        assert!(!page.is_empty());
        for part in page.split("/ui/").skip(1) {
            let name: String = part
                .chars()
                .take_while(|c| !matches!(c, '"' | '\'' | ' ' | '>'))
                .collect();
            assert!(find(&name).is_some(), "index.html names /ui/{name}");
        }
    }

    /// The module names a script imports: `import … from "./x.js"` and `import("./x.js")`.
    fn imports(text: &str) -> Vec<String> {
        let mut names = Vec::new();
        for (i, _) in text.match_indices("\"./") {
            let before = &text[..i];
            if before.ends_with("from ") || before.ends_with("import(") {
                let rest = &text[i + 3..];
                if let Some(end) = rest.find('"') {
                    names.push(format!("js/{}", &rest[..end]));
                }
            }
        }
        names
    }

    #[test]
    fn every_module_import_is_served() {
        let mut seen = 0;
        for asset in ASSETS.iter().filter(|a| a.name.ends_with(".js")) {
            let text = std::str::from_utf8(asset.body).unwrap_or_default();
            for name in imports(text) {
                assert!(find(&name).is_some(), "{} imports {name}", asset.name);
                seen += 1;
            }
        }
        assert!(seen > 5, "found {seen} imports");
        // Every script is reachable from app.js, so none is listed without being used.
        let mut reached = vec!["js/app.js".to_string()];
        let mut i = 0;
        while i < reached.len() {
            let text = find(&reached[i]).map(|a| a.body).unwrap_or_default();
            for name in imports(std::str::from_utf8(text).unwrap_or_default()) {
                if !reached.contains(&name) {
                    reached.push(name);
                }
            }
            i += 1;
        }
        for asset in ASSETS.iter().filter(|a| a.name.ends_with(".js")) {
            assert!(
                reached.iter().any(|r| r == asset.name),
                "{} is never imported",
                asset.name
            );
        }
    }

    #[test]
    fn the_page_has_no_inline_script_or_style() {
        let page = std::str::from_utf8(find("index.html").map(|a| a.body).unwrap_or_default())
            .unwrap_or_default();
        for (i, _) in page.match_indices("<script") {
            let tag: String = page[i..].chars().take_while(|&c| c != '>').collect();
            assert!(tag.contains("src="), "inline script: {tag}");
        }
        assert!(!page.contains("<style"), "inline style");
        assert!(!page.contains(" style="), "inline style attribute");
        let handler = page.split_whitespace().any(|word| {
            word.strip_prefix("on")
                .and_then(|rest| rest.split_once('='))
                .is_some_and(|(name, _)| name.chars().all(|c| c.is_ascii_lowercase()))
        });
        assert!(!handler, "inline event handler");
    }

    #[test]
    fn answers_carry_type_policy_and_etag_and_revalidate() {
        let asset = find("js/app.js").map(|a| serve(a, &HeaderMap::new()));
        let Some(response) = asset else {
            panic!("js/app.js missing");
        };
        assert_eq!(response.status(), StatusCode::OK);
        let h = response.headers();
        assert_eq!(h[CONTENT_TYPE], JS);
        assert_eq!(h[CACHE_CONTROL], "no-cache");
        assert_eq!(h[X_CONTENT_TYPE_OPTIONS], "nosniff");
        assert!(h[CONTENT_SECURITY_POLICY]
            .to_str()
            .is_ok_and(|v| v.contains("script-src 'self'") && !v.contains("unsafe")));
        let mut again = HeaderMap::new();
        again.insert(IF_NONE_MATCH, h[ETAG].clone());
        let cached = find("js/app.js").map(|a| serve(a, &again));
        assert_eq!(cached.map(|r| r.status()), Some(StatusCode::NOT_MODIFIED));
    }

    #[test]
    fn hashes_differ_between_files() {
        assert_ne!(fnv1a(b"a"), fnv1a(b"b"));
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
    }
}
