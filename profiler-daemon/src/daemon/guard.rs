//! What a request must pass before a handler sees it: no body (no endpoint takes one, and a body
//! that never comes would hold the connection), and basic auth when the web config has users.
//! Each refusal is counted.

use std::{
    collections::{BTreeMap, HashSet},
    sync::{Arc, Mutex},
};

use axum::{
    extract::{Request, State},
    http::{header, HeaderMap, StatusCode},
    middleware::Next,
    response::{IntoResponse, Response},
};
use base64::Engine as _;
use ring::digest;

use super::server::{Refusal, Stats};

/// Users and their bcrypt hashes.
pub struct BasicAuth {
    users: BTreeMap<String, String>,
    /// Compared against when the user is unknown, so that the time taken does not tell which
    /// users exist.
    decoy: String,
    /// SHA-256 of credentials bcrypt accepted: bcrypt is slow on purpose (tens of ms), and
    /// Prometheus sends the same credentials with every scrape.
    accepted: Mutex<HashSet<[u8; 32]>>,
    /// One bcrypt at a time, off the async thread: wrong passwords cost the attacker's requests
    /// time, not scrapes with credentials already accepted.
    bcrypt: tokio::sync::Mutex<()>,
}

/// More distinct accepted credentials than this empties the cache (they are rechecked).
const MAX_ACCEPTED: usize = 1024;

impl BasicAuth {
    pub fn new(users: BTreeMap<String, String>) -> Result<Self, String> {
        let mut cost = 10;
        for (user, hash) in &users {
            let parts: bcrypt::HashParts = hash.parse().map_err(|e| {
                format!("the password of `{user}` is not a bcrypt hash ({e}): make one with `htpasswd -nBC 10 \"\" | tr -d ':\\n'`")
            })?;
            cost = parts.get_cost();
        }
        let decoy = bcrypt::hash("memprof: no such user", cost).map_err(|e| e.to_string())?;
        Ok(Self { users, decoy, accepted: Mutex::new(HashSet::new()), bcrypt: tokio::sync::Mutex::new(()) })
    }

    /// Whether `headers` carry the credentials of a user.
    pub async fn allows(self: &Arc<Self>, headers: &HeaderMap) -> bool {
        let Some((user, password)) = credentials(headers) else { return false };
        let key = fingerprint(&user, &password);
        if self.accepted.lock().unwrap_or_else(|e| e.into_inner()).contains(&key) {
            return true;
        }
        let known = self.users.contains_key(&user);
        let hash = self.users.get(&user).unwrap_or(&self.decoy).clone();
        let _one_at_a_time = self.bcrypt.lock().await;
        let matches = tokio::task::spawn_blocking(move || bcrypt::verify(password, &hash).unwrap_or(false))
            .await
            .unwrap_or(false);
        if known && matches {
            let mut accepted = self.accepted.lock().unwrap_or_else(|e| e.into_inner());
            if accepted.len() >= MAX_ACCEPTED {
                accepted.clear();
            }
            accepted.insert(key);
        }
        known && matches
    }
}

/// The user and password of an `Authorization: Basic` header.
fn credentials(headers: &HeaderMap) -> Option<(String, String)> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, encoded) = value.trim().split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("basic") {
        return None;
    }
    let decoded = base64::engine::general_purpose::STANDARD.decode(encoded.trim()).ok()?;
    let (user, password) = std::str::from_utf8(&decoded).ok()?.split_once(':')?;
    Some((user.to_string(), password.to_string()))
}

fn fingerprint(user: &str, password: &str) -> [u8; 32] {
    let mut context = digest::Context::new(&digest::SHA256);
    // The length first, so that ("a:b", "c") and ("a", "b:c") differ.
    context.update(&(user.len() as u64).to_le_bytes());
    context.update(user.as_bytes());
    context.update(password.as_bytes());
    context.finish().as_ref().try_into().expect("SHA-256 is 32 bytes")
}

/// The guard's state: the counters and the users, if any.
#[derive(Clone)]
pub struct Guard {
    pub stats: Arc<Stats>,
    pub auth: Option<Arc<BasicAuth>>,
}

/// axum middleware: refuses requests with a body (413) and without valid credentials (401).
pub async fn check(State(guard): State<Guard>, request: Request, next: Next) -> Response {
    let headers = request.headers();
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .is_some_and(|len| len.to_str().ok().and_then(|n| n.parse::<u64>().ok()) != Some(0));
    if declared || headers.contains_key(header::TRANSFER_ENCODING) {
        guard.stats.refuse(Refusal::Body);
        // Closing the connection: the body is not read, so it cannot carry another request.
        let mut response = refusal(StatusCode::PAYLOAD_TOO_LARGE, "memprof's endpoints take no request body");
        response.headers_mut().insert(header::CONNECTION, header::HeaderValue::from_static("close"));
        return response;
    }
    if let Some(auth) = &guard.auth {
        if !auth.allows(headers).await {
            guard.stats.refuse(Refusal::Unauthorized);
            let mut response = refusal(StatusCode::UNAUTHORIZED, "authentication required: give a user and password");
            response.headers_mut().insert(header::WWW_AUTHENTICATE, header::HeaderValue::from_static("Basic"));
            return response;
        }
    }
    next.run(request).await
}

fn refusal(status: StatusCode, message: &'static str) -> Response {
    (status, axum::Json(serde_json::json!({ "error": message }))).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn basic(user_and_password: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        let encoded = base64::engine::general_purpose::STANDARD.encode(user_and_password);
        headers.insert(header::AUTHORIZATION, format!("Basic {encoded}").parse().unwrap());
        headers
    }

    #[tokio::test]
    async fn only_a_users_own_password_passes() {
        let users = BTreeMap::from([("alice".to_string(), bcrypt::hash("secret", 4).unwrap())]);
        let auth = Arc::new(BasicAuth::new(users).unwrap());
        assert!(auth.allows(&basic("alice:secret")).await);
        assert!(auth.allows(&basic("alice:secret")).await, "again, from the cache");
        assert!(!auth.allows(&basic("alice:wrong")).await);
        assert!(!auth.allows(&basic("bob:secret")).await);
        assert!(!auth.allows(&basic("alice")).await);
        assert!(!auth.allows(&HeaderMap::new()).await);
        let mut bearer = HeaderMap::new();
        bearer.insert(header::AUTHORIZATION, "Bearer x".parse().unwrap());
        assert!(!auth.allows(&bearer).await);
    }
}
