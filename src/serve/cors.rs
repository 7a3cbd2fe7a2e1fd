//! Which web pages may call the API from a browser (CORS).
//!
//! A page served from another origin (a web chat front end on `http://localhost:3000`, a desktop
//! app built on a browser engine) may call the API only where the server's answers name its
//! origin: the browser asks first with an `OPTIONS` preflight, then checks the real answer's
//! `Access-Control-Allow-Origin`. By default sift allows pages served from this machine
//! (`localhost`, `127.0.0.1` or `[::1]`, any port, http or https) and no others, so that a web
//! site the user visits cannot drive the model from the user's browser; `--cors-origin` names
//! more, or `*` for any. Where an API key is set, a cross-origin request needs it like any other
//! (the preflight itself carries no key and is answered without one). The chat page at `/` is
//! the server's own origin and needs none of this.

use std::net::IpAddr;
use std::time::Duration;

use axum::http::{header, HeaderValue, Method, Uri};
use tower_http::cors::{AllowHeaders, AllowOrigin, CorsLayer};

/// The origins allowed besides this machine's own pages.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Origins {
    /// This machine's pages only.
    #[default]
    Local,
    /// This machine's pages and these origins, as `scheme://host[:port]`.
    Listed(Vec<String>),
    /// Any origin (`*`).
    Any,
}

impl Origins {
    /// The origins of `--cors-origin` flags: each `scheme://host[:port]` (http or https), or `*`.
    pub fn parse(given: &[String]) -> Result<Self, String> {
        if given.iter().any(|o| o == "*") {
            return Ok(Self::Any);
        }
        if given.is_empty() {
            return Ok(Self::Local);
        }
        let listed = given.iter().map(|o| origin(o)).collect::<Result<_, _>>()?;
        Ok(Self::Listed(listed))
    }

    /// Whether a page of `origin` (an `Origin` header's value) may call the API.
    pub fn allows(&self, origin: &str) -> bool {
        match self {
            Self::Any => true,
            Self::Local => is_local(origin),
            Self::Listed(listed) => is_local(origin) || listed.iter().any(|o| o.eq_ignore_ascii_case(origin)),
        }
    }

    /// The layer that answers preflights and marks the answers of allowed origins.
    pub fn layer(&self) -> CorsLayer {
        let allowed = match self {
            Self::Any => AllowOrigin::any(),
            origins => {
                let origins = origins.clone();
                AllowOrigin::predicate(move |origin: &HeaderValue, _| {
                    origin.to_str().is_ok_and(|origin| origins.allows(origin))
                })
            }
        };
        CorsLayer::new()
            .allow_origin(allowed)
            .allow_methods([Method::GET, Method::POST, Method::DELETE])
            // Whatever headers the page asks to send: the key as OpenAI's clients send it or as
            // Anthropic's do, with their version, and the SDKs' own (`x-stainless-*`), which
            // grow with their releases. Which pages may call is the origin's to decide, and the
            // key is asked of every one.
            .allow_headers(AllowHeaders::mirror_request())
            .expose_headers([header::RETRY_AFTER])
            .max_age(Duration::from_secs(600))
    }
}

/// `given` as an origin, `scheme://host[:port]` without a trailing slash, or why it is not one.
fn origin(given: &str) -> Result<String, String> {
    let trimmed = given.strip_suffix('/').unwrap_or(given);
    let bare = |uri: &Uri| uri.path_and_query().is_none_or(|p| p.as_str().is_empty() || p.as_str() == "/");
    match web(trimmed) {
        Some(uri) if bare(&uri) => Ok(trimmed.to_string()),
        _ => Err(format!("--cors-origin {given:?} is not an origin like http://host:port, nor *")),
    }
}

/// Whether `origin` is a page served from this machine.
fn is_local(origin: &str) -> bool {
    let Some(uri) = web(origin) else { return false };
    let host = uri.host().unwrap_or_default();
    host.eq_ignore_ascii_case("localhost")
        || host.trim_start_matches('[').trim_end_matches(']').parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// `text` as an http or https address with a host.
fn web(text: &str) -> Option<Uri> {
    let uri: Uri = text.parse().ok()?;
    (matches!(uri.scheme_str(), Some("http" | "https")) && uri.host().is_some()).then_some(uri)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_of_this_machine_are_allowed_by_default_and_no_others() {
        let local = Origins::parse(&[]).unwrap();
        for origin in ["http://localhost:3000", "http://127.0.0.1:8080", "https://localhost", "http://[::1]:5173"] {
            assert!(local.allows(origin), "{origin}");
        }
        for origin in ["https://example.com", "http://localhost.example.com", "http://192.168.1.2:3000", "null", ""] {
            assert!(!local.allows(origin), "{origin}");
        }
    }

    #[test]
    fn listed_origins_are_allowed_besides_the_local_ones() {
        let listed = Origins::parse(&["https://chat.example.com/".into()]).unwrap();
        assert_eq!(listed, Origins::Listed(vec!["https://chat.example.com".into()]));
        assert!(listed.allows("https://chat.example.com"));
        assert!(listed.allows("http://localhost:3000"));
        assert!(!listed.allows("https://example.com"));
        assert_eq!(Origins::parse(&["https://a.example".into(), "*".into()]), Ok(Origins::Any));
        assert!(Origins::Any.allows("https://anything.example"));
    }

    #[test]
    fn what_is_not_an_origin_is_refused() {
        for given in ["example.com", "ftp://example.com", "https://example.com/chat", "http://"] {
            let error = Origins::parse(&[given.into()]).unwrap_err();
            assert!(error.contains("not an origin"), "{given}: {error}");
        }
    }
}
