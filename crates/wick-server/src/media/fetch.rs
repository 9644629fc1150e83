//! Fetching a media URL for a request, without letting the request reach the server's own
//! network: `http(s)` only, every address a host name resolves to checked (the connection
//! goes to a checked address, so a second DNS answer cannot swap it), redirects limited and
//! each hop checked again, a time limit and a size limit.
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use ureq::config::Config;
use ureq::http::Uri;
use ureq::unversioned::resolver::{DefaultResolver, ResolvedSocketAddrs, Resolver};
use ureq::unversioned::transport::{DefaultConnector, NextTimeout};

use super::MediaPolicy;

/// Why a URL could not be fetched.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FetchError {
    /// Not `http` or `https`.
    #[error("only http and https URLs are fetched, not '{0}'")]
    Scheme(String),
    /// The host resolves to an address the server does not fetch from.
    #[error("'{host}' resolves to {addr}, a loopback, private, link-local or otherwise non-public address; media URLs must be public (or start the server with --allow-private-media)")]
    PrivateAddress {
        /// The host name.
        host: String,
        /// The refused address.
        addr: IpAddr,
    },
    /// The server answered with an error status.
    #[error("fetching the URL answered HTTP {0}")]
    Status(u16),
    /// Larger than allowed.
    #[error("the fetched body is larger than the limit of {0} bytes")]
    TooLarge(usize),
    /// Took too long.
    #[error("fetching the URL took longer than {0} s")]
    Timeout(u64),
    /// Too many redirects.
    #[error("fetching the URL followed more than {0} redirects")]
    Redirects(u32),
    /// Anything else (DNS failure, refused connection, bad URL).
    #[error("could not fetch the URL: {0}")]
    Other(String),
}

/// Whether an address is one the server's own network uses rather than the public internet.
pub fn is_non_public(addr: IpAddr) -> bool {
    match addr {
        IpAddr::V4(v4) => {
            let [a, b, ..] = v4.octets();
            v4.is_loopback()
                || v4.is_private()
                || v4.is_link_local()
                || v4.is_unspecified()
                || v4.is_multicast()
                || v4.is_broadcast()
                || v4.is_documentation()
                || a == 0
                // Carrier-grade NAT 100.64/10 and benchmarking 198.18/15.
                || (a == 100 && (64..128).contains(&b))
                || (a == 198 && (b == 18 || b == 19))
                || a >= 240
        }
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return is_non_public(IpAddr::V4(v4));
            }
            let first = v6.segments()[0];
            v6.is_loopback()
                || v6.is_unspecified()
                || v6.is_multicast()
                // Unique local fc00::/7, link-local fe80::/10, site-local fec0::/10.
                || (first & 0xfe00) == 0xfc00
                || (first & 0xffc0) == 0xfe80
                || (first & 0xffc0) == 0xfec0
                // NAT64 of an IPv4 address is judged by that address.
                || (first == 0x64 && v6.segments()[1] == 0xff9b && {
                    let s = v6.segments();
                    let v4 = std::net::Ipv4Addr::new((s[6] >> 8) as u8, s[6] as u8, (s[7] >> 8) as u8, s[7] as u8);
                    is_non_public(IpAddr::V4(v4))
                })
        }
    }
}

/// Resolves as usual, then refuses when any address is non-public (unless allowed): the
/// addresses returned are the ones connected to.
#[derive(Debug)]
struct CheckedResolver {
    allow_private: bool,
    refused: Arc<Mutex<Option<(String, IpAddr)>>>,
}

impl Resolver for CheckedResolver {
    fn resolve(
        &self,
        uri: &Uri,
        config: &Config,
        timeout: NextTimeout,
    ) -> Result<ResolvedSocketAddrs, ureq::Error> {
        let addrs = DefaultResolver::default().resolve(uri, config, timeout)?;
        if !self.allow_private {
            if let Some(bad) = addrs.iter().find(|a| is_non_public(a.ip())) {
                let host = uri.host().unwrap_or_default().to_string();
                if let Ok(mut slot) = self.refused.lock() {
                    *slot = Some((host, bad.ip()));
                }
                return Err(ureq::Error::HostNotFound);
            }
        }
        Ok(addrs)
    }
}

/// Fetches `url` within `policy`, at most `max_bytes`.
pub fn fetch(url: &str, policy: &MediaPolicy, max_bytes: usize) -> Result<Vec<u8>, FetchError> {
    let scheme = url
        .split_once("://")
        .map(|(s, _)| s.to_ascii_lowercase())
        .unwrap_or_default();
    if scheme != "http" && scheme != "https" {
        return Err(FetchError::Scheme(scheme));
    }
    let refused = Arc::new(Mutex::new(None));
    let config = Config::builder()
        .timeout_global(Some(policy.fetch_timeout))
        .max_redirects(policy.max_redirects)
        .max_redirects_will_error(true)
        .http_status_as_error(false)
        .proxy(None)
        .user_agent("wick (media fetch)")
        .build();
    let agent = ureq::Agent::with_parts(
        config,
        DefaultConnector::default(),
        CheckedResolver {
            allow_private: policy.allow_private,
            refused: refused.clone(),
        },
    );
    let outcome = agent.get(url).call();
    let refused_addr = refused.lock().ok().and_then(|mut r| r.take());
    if let Some((host, addr)) = refused_addr {
        return Err(FetchError::PrivateAddress { host, addr });
    }
    let mut response = outcome.map_err(|e| classify(e, policy))?;
    let status = response.status().as_u16();
    if !(200..300).contains(&status) {
        return Err(FetchError::Status(status));
    }
    if let Some(len) = response
        .headers()
        .get("content-length")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
    {
        if len > max_bytes as u64 {
            return Err(FetchError::TooLarge(max_bytes));
        }
    }
    response
        .body_mut()
        .with_config()
        .limit(max_bytes as u64)
        .read_to_vec()
        .map_err(|e| match e {
            ureq::Error::BodyExceedsLimit(_) => FetchError::TooLarge(max_bytes),
            other => classify(other, policy),
        })
}

fn classify(e: ureq::Error, policy: &MediaPolicy) -> FetchError {
    match e {
        ureq::Error::Timeout(_) => FetchError::Timeout(policy.fetch_timeout.as_secs()),
        ureq::Error::TooManyRedirects => FetchError::Redirects(policy.max_redirects),
        ureq::Error::StatusCode(code) => FetchError::Status(code),
        ureq::Error::BodyExceedsLimit(_) => FetchError::Other("body too large".into()),
        other => FetchError::Other(other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn non_public_addresses() {
        for a in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "0.0.0.0",
            "224.0.0.1",
            "100.64.0.1",
            "::1",
            "::",
            "fc00::1",
            "fd12::1",
            "fe80::1",
            "ff02::1",
            "::ffff:127.0.0.1",
            "::ffff:10.0.0.1",
            "64:ff9b::7f00:1",
        ] {
            assert!(is_non_public(a.parse().unwrap()), "{a}");
        }
        for a in ["8.8.8.8", "1.1.1.1", "2606:4700::1111", "64:ff9b::808:808"] {
            assert!(!is_non_public(a.parse().unwrap()), "{a}");
        }
    }

    /// A one-connection-at-a-time HTTP server on 127.0.0.1 answering every request with
    /// `response`; its address.
    fn local_server(response: &'static [u8]) -> std::net::SocketAddr {
        use std::io::{Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let mut stream = stream;
                let mut buf = [0u8; 4096];
                let _ = stream.read(&mut buf);
                let _ = stream.write_all(response);
            }
        });
        addr
    }

    #[test]
    fn loopback_is_refused_unless_allowed() {
        let addr =
            local_server(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello");
        let url = format!("http://{addr}/a.png");
        let err = fetch(&url, &MediaPolicy::default(), 100).unwrap_err();
        assert!(matches!(err, FetchError::PrivateAddress { .. }), "{err:?}");
        assert!(err.to_string().contains("--allow-private-media"));
        // "localhost" resolves to loopback too.
        let url_by_name = format!("http://localhost:{}/a.png", addr.port());
        let err = fetch(&url_by_name, &MediaPolicy::default(), 100).unwrap_err();
        assert!(matches!(err, FetchError::PrivateAddress { .. }), "{err:?}");

        let allowed = MediaPolicy {
            allow_private: true,
            ..MediaPolicy::default()
        };
        assert_eq!(fetch(&url, &allowed, 100).unwrap(), b"hello");
        // The size limit holds.
        assert_eq!(
            fetch(&url, &allowed, 3).unwrap_err(),
            FetchError::TooLarge(3)
        );
    }

    #[test]
    fn error_statuses_and_redirects_to_private_addresses() {
        let allowed = MediaPolicy {
            allow_private: true,
            ..MediaPolicy::default()
        };
        let missing = local_server(
            b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
        );
        let err = fetch(&format!("http://{missing}/x"), &allowed, 100).unwrap_err();
        assert_eq!(err, FetchError::Status(404));
        // A redirect hop is resolved and checked like the first URL.
        let redirect = local_server(
            b"HTTP/1.1 302 Found\r\nLocation: http://10.255.255.1/secret\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
        );
        let policy = MediaPolicy {
            allow_private: false,
            ..MediaPolicy::default()
        };
        // The first hop (loopback) is already refused; with loopback allowed only through a
        // resolver that trusts it, the hop to 10/8 would be checked the same way.
        let err = fetch(&format!("http://{redirect}/"), &policy, 100).unwrap_err();
        assert!(matches!(err, FetchError::PrivateAddress { .. }), "{err:?}");
    }

    #[test]
    fn other_schemes_are_refused() {
        let err = fetch("ftp://example.com/a.png", &MediaPolicy::default(), 10).unwrap_err();
        assert_eq!(err, FetchError::Scheme("ftp".into()));
    }
}
