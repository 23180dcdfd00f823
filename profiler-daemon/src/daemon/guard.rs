//! What a request must pass before a handler sees it: no body (no endpoint takes one, and a body
//! that never comes would hold the connection); then, unless the Unix socket's peer is trusted
//! (`access`), basic auth when the web config has users, and without users only the public paths.
//! Each refusal is counted.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    net::IpAddr,
    sync::{Arc, Mutex},
    time::Duration,
};

use axum::{
    extract::{Request, State},
    http::{header, HeaderMap, StatusCode},
    middleware::Next,
    response::{IntoResponse, Response},
};
use base64::Engine as _;
use ring::{hmac, rand::SystemRandom};
use tokio::sync::Semaphore;

use super::{
    access,
    clients::{Client, ClientId},
    server::{Refusal, Stats},
};

/// Users and their bcrypt hashes.
pub struct BasicAuth {
    users: BTreeMap<String, String>,
    /// Compared against when the user is unknown, so that the time taken does not tell which
    /// users exist.
    decoy: String,
    /// Keyed hashes of credentials bcrypt accepted: bcrypt is slow on purpose (tens of ms), and
    /// Prometheus sends the same credentials with every scrape. The key is made at start, so the
    /// cache tells nothing about the passwords.
    accepted: Mutex<HashSet<[u8; 32]>>,
    key: hmac::Key,
    /// Checks run at once, off the async thread. No single queue: a client has at most
    /// `CHECKS_PER_CLIENT` under way and its next is refused at once (429), so that a flood of
    /// wrong passwords from one client (a host, or a user of this one) does not stand in front
    /// of another's login.
    checks: Semaphore,
    checking: Mutex<HashMap<ClientId, usize>>,
}

/// Distinct accepted credentials kept; more empty the cache (they are checked again).
const MAX_ACCEPTED: usize = 1024;
/// The dearest bcrypt cost accepted: each step doubles a check's time (cost 10, the usual, takes
/// tens of milliseconds; 31 would take days).
const MAX_COST: u32 = 16;
/// bcrypt checks under way at once, all clients together.
const CHECKS: usize = 4;
const CHECKS_PER_CLIENT: usize = 1;
/// How long a check waits for one of the `CHECKS` before the request gets 429.
const CHECK_WAIT: Duration = Duration::from_secs(5);

/// What a request's credentials got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Allowed,
    Denied,
    /// Its client had a check under way already, or none was free in time: not checked.
    Busy,
}

impl BasicAuth {
    pub fn new(users: BTreeMap<String, String>) -> Result<Self, String> {
        // The decoy costs what the dearest user's check does: a name that is not a user's must
        // take no less time than one that is.
        let mut cost = 4;
        for (user, hash) in &users {
            let parts: bcrypt::HashParts = hash.parse().map_err(|e| {
                format!("the password of `{user}` is not a bcrypt hash ({e}): make one with `htpasswd -nBC 10 \"\" | tr -d ':\\n'`")
            })?;
            if parts.get_cost() > MAX_COST {
                return Err(format!(
                    "the password hash of `{user}` has a bcrypt cost of {}, above {MAX_COST}: each check would take minutes or days; make one with `htpasswd -nBC 10 \"\" | tr -d ':\\n'`",
                    parts.get_cost()
                ));
            }
            cost = cost.max(parts.get_cost());
        }
        let decoy = bcrypt::hash("memprof: no such user", cost).map_err(|e| e.to_string())?;
        let key = hmac::Key::generate(hmac::HMAC_SHA256, &SystemRandom::new())
            .map_err(|_| "the system's random number generator failed".to_string())?;
        Ok(Self {
            users,
            decoy,
            accepted: Mutex::new(HashSet::new()),
            key,
            checks: Semaphore::new(CHECKS),
            checking: Mutex::new(HashMap::new()),
        })
    }

    /// Whether `headers` carry the credentials of a user; `client` is where they came from.
    pub async fn check(self: &Arc<Self>, headers: &HeaderMap, client: Option<ClientId>) -> Verdict {
        let Some((user, password)) = credentials(headers) else { return Verdict::Denied };
        let fingerprint = self.fingerprint(&user, &password);
        if self.accepted.lock().unwrap_or_else(|e| e.into_inner()).contains(&fingerprint) {
            return Verdict::Allowed;
        }
        let client = client.unwrap_or(ClientId::Address(IpAddr::from([0, 0, 0, 0])));
        let Some(_turn) = ClientTurn::take(self, client) else { return Verdict::Busy };
        let Ok(Ok(_check)) = tokio::time::timeout(CHECK_WAIT, self.checks.acquire()).await else {
            return Verdict::Busy;
        };
        let known = self.users.contains_key(&user);
        let hash = self.users.get(&user).unwrap_or(&self.decoy).clone();
        let matches = tokio::task::spawn_blocking(move || bcrypt::verify(password, &hash).unwrap_or(false))
            .await
            .unwrap_or(false);
        if !(known && matches) {
            return Verdict::Denied;
        }
        let mut accepted = self.accepted.lock().unwrap_or_else(|e| e.into_inner());
        if accepted.len() >= MAX_ACCEPTED {
            accepted.clear();
        }
        accepted.insert(fingerprint);
        Verdict::Allowed
    }

    fn fingerprint(&self, user: &str, password: &str) -> [u8; 32] {
        let mut context = hmac::Context::with_key(&self.key);
        // The length first, so that ("a:b", "c") and ("a", "b:c") differ.
        context.update(&(user.len() as u64).to_le_bytes());
        context.update(user.as_bytes());
        context.update(password.as_bytes());
        context.sign().as_ref().try_into().expect("HMAC-SHA256 is 32 bytes")
    }
}

/// One of a client's `CHECKS_PER_CLIENT`, given back when dropped.
struct ClientTurn<'a> {
    auth: &'a BasicAuth,
    client: ClientId,
}

impl<'a> ClientTurn<'a> {
    fn take(auth: &'a BasicAuth, client: ClientId) -> Option<Self> {
        let mut checking = auth.checking.lock().unwrap_or_else(|e| e.into_inner());
        let count = checking.entry(client).or_default();
        if *count >= CHECKS_PER_CLIENT {
            return None;
        }
        *count += 1;
        Some(Self { auth, client })
    }
}

impl Drop for ClientTurn<'_> {
    fn drop(&mut self) {
        let mut checking = self.auth.checking.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(count) = checking.get_mut(&self.client) {
            *count -= 1;
            if *count == 0 {
                checking.remove(&self.client);
            }
        }
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

/// The guard's state: the counters, the users, if any, and who the socket trusts.
#[derive(Clone)]
pub struct Guard {
    pub stats: Arc<Stats>,
    pub auth: Option<Arc<BasicAuth>>,
    pub access: Arc<access::Settings>,
}

/// axum middleware: refuses requests with a body (413), without valid credentials where users
/// are set (401), and for a path that is not public where none are set (403); a peer the socket
/// trusts passes without credentials.
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
    let client = request.extensions().get::<Client>();
    if client.and_then(|c| c.local.as_ref()).is_some_and(|peer| guard.access.trusts(peer)) {
        return next.run(request).await;
    }
    if let Some(auth) = &guard.auth {
        match auth.check(headers, client.map(|c| c.id)).await {
            Verdict::Allowed => {}
            Verdict::Denied => {
                guard.stats.refuse(Refusal::Unauthorized);
                let mut response =
                    refusal(StatusCode::UNAUTHORIZED, "authentication required: give a user and password");
                response.headers_mut().insert(header::WWW_AUTHENTICATE, header::HeaderValue::from_static("Basic"));
                return response;
            }
            Verdict::Busy => {
                guard.stats.refuse(Refusal::AuthBusy);
                return refusal(
                    StatusCode::TOO_MANY_REQUESTS,
                    "a password check of this client is under way: wait for its answer before sending another",
                );
            }
        }
    } else if !access::is_public(request.uri().path()) {
        guard.stats.refuse(Refusal::Forbidden);
        return refusal(
            StatusCode::FORBIDDEN,
            "this path shows or acts on traced processes: ask as root over the daemon's socket \
             (as memprof inspect and snapshot do), or give the daemon users in a web config (docs: daemon/securing.md#securing-the-listener)",
        );
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
        let allows = |headers: HeaderMap| {
            let auth = auth.clone();
            async move { auth.check(&headers, None).await == Verdict::Allowed }
        };
        assert!(allows(basic("alice:secret")).await);
        assert!(allows(basic("alice:secret")).await, "again, from the cache");
        assert!(!allows(basic("alice:wrong")).await);
        assert!(!allows(basic("bob:secret")).await);
        assert!(!allows(basic("alice")).await);
        assert!(!allows(HeaderMap::new()).await);
        let mut bearer = HeaderMap::new();
        bearer.insert(header::AUTHORIZATION, "Bearer x".parse().unwrap());
        assert!(!allows(bearer).await);
    }
}
