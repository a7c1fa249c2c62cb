//! Redis for idem, two ways:
//!
//! - [`RedisStore`]: a store of its own, for services without a SQL database.
//!   A claim first looks with plain commands in one round trip, no script:
//!   `SET … NX GET PX`, `TIME` and `PEXPIRETIME`. A key that holds nothing is
//!   claimed by it; a replay, or a duplicate of a claim still running, is
//!   answered by it alone (the `SET` writes nothing where a value is and
//!   returns it). A takeover and a record past its retention are decided by
//!   the claim script (a second round trip). Complete and release are one
//!   round trip each. The scripts are Lua, loaded once and called by SHA,
//!   atomic, fenced by token; leases and retention are Redis's clock and
//!   expirations: a claim made by the `SET` counts its times from its key's
//!   expiry, so not even it is stamped with this process's clock. Needs
//!   Redis 7.0 or later (or Valkey): `SET` with both `NX` and `GET`.
//! - [`TieredStore`]: Redis **in front of** a SQL store. Completed records
//!   are cached for replay and in-flight collisions are answered from Redis;
//!   the SQL store stays the source of truth and the only place a claim is
//!   decided. A miss, an eviction, a `FLUSHALL` or a Redis outage falls
//!   through to SQL: slower, never a duplicate effect, never an error.
//!
//! ```no_run
//! use std::sync::Arc;
//! use idem_redis::{RedisConfig, RedisStore, TieredStore};
//!
//! # async fn f() -> Result<(), idem_core::StoreError> {
//! // Redis alone
//! let redis = RedisStore::connect(RedisConfig::new("redis://127.0.0.1:6379").prefix("billing")).await?;
//! // Redis in front of SQLite (or PostgreSQL)
//! let sql = idem_sqlite::SqliteStore::connect("sqlite:app.db").await?;
//! let tiered = TieredStore::new(sql, redis);
//! # let _ = tiered; Ok(()) }
//! ```
//!
//! # Keys
//!
//! A record lives in one value, `{prefix}:{<digest>}`, where the digest
//! (SHA-256 of scope and key, hex) is a hash tag: every key of one record
//! maps to one slot of a Redis Cluster. The value is a MessagePack array
//! (its layout is versioned; the scope and key are kept inside it for
//! operators). Records an earlier idem wrote as hashes are still read, and
//! rewritten as one value when they change; an earlier idem cannot read the
//! new layout (`WRONGTYPE`: an error for that key, never a second run), so
//! upgrade every instance sharing a prefix before relying on its replays.
//!
//! # What Redis alone does not guarantee
//!
//! See the Redis guide (`idem::guide::redis`): the record cannot commit with a SQL business write; a
//! crash between the effect and the completion lets a retry run again after
//! the lease; and what a Redis restart forgets depends on its persistence
//! settings (`appendonly yes`, `appendfsync everysec` or `always`).

mod config;
mod conn;
mod decode;
mod ops;
mod scripts;
mod tier;
mod value;

use std::time::Duration;

use idem_core::{
    BoxFuture, Claim, ClaimOutcome, ClaimRequest, FencingToken, Fingerprint, OperationId, Record,
    RecordState, Store, StoreError, StoredResponse, UnixMillis,
};
use redis::aio::ConnectionManagerConfig;
use redis::{Script, Value};
use sha2::{Digest, Sha256};

pub use config::{RedisConfig, WaitReplicas};
pub use tier::TieredStore;

use conn::{Conn, Single};
use decode::{bytes_of, decode, number, parse_op, redis_time, text};
use value::{KeyClock, NewClaim};

/// The Redis store; see the crate-level docs.
#[derive(Clone)]
pub struct RedisStore {
    conn: Conn,
    /// The cluster's seed nodes, to find every primary for key scans.
    cluster: Option<Vec<String>>,
    timeout: Duration,
    /// With [`RedisConfig::wait_replicas`]: how many replicas, and the
    /// connection the writes that `WAIT` go on.
    waiting: Option<Waiting>,
    prefix: String,
    claim: Script,
    complete: Script,
    release: Script,
    cache_put: Script,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

/// A connection to the one server `config` names, reconnecting by itself
/// (and afresh after a time-out).
async fn single(config: &RedisConfig) -> Result<Single, StoreError> {
    let client =
        redis::Client::open(config.url.as_str()).map_err(|e| StoreError::Backend(Box::new(e)))?;
    let manager = ConnectionManagerConfig::new()
        .set_response_timeout(Some(config.timeout))
        .set_connection_timeout(Some(config.timeout))
        .set_number_of_retries(1)
        .set_max_delay(Duration::from_millis(500));
    Single::connect(client, manager).await.map_err(store_error)
}

/// [`RedisConfig::wait_replicas`] at work: how many replicas, and the
/// connection kept for the writes that wait for them.
#[derive(Clone)]
struct Waiting {
    wait: WaitReplicas,
    conn: Conn,
}

/// A connection to what `config` names: one server, or a cluster.
async fn connection(config: &RedisConfig) -> Result<Conn, StoreError> {
    let Some(nodes) = &config.cluster else {
        return Ok(Conn::Single(single(config).await?));
    };
    let client = redis::cluster::ClusterClient::builder(nodes.iter().map(String::as_str))
        .connection_timeout(config.timeout)
        .response_timeout(config.timeout)
        .retries(2)
        .build()
        .map_err(|e| StoreError::Backend(Box::new(e)))?;
    Ok(Conn::Cluster(
        client.get_async_connection().await.map_err(store_error)?,
    ))
}

/// `WAIT replicas timeout-ms`.
fn wait_cmd(wait: WaitReplicas) -> redis::Cmd {
    let mut cmd = redis::cmd("WAIT");
    cmd.arg(wait.replicas).arg(
        i64::try_from(wait.timeout.as_millis())
            .unwrap_or(i64::MAX)
            .max(1),
    );
    cmd
}

/// Whether `acked` replicas are enough for `wait`.
fn acknowledged(wait: WaitReplicas, acked: i64) -> Result<(), StoreError> {
    if acked >= i64::from(wait.replicas) {
        return Ok(());
    }
    tracing::warn!(
        wanted = wait.replicas,
        acknowledged = acked,
        "a write was not acknowledged by enough replicas in time"
    );
    Err(StoreError::Unavailable(Box::new(NotReplicated {
        wanted: wait.replicas,
        acknowledged: acked,
        timeout: wait.timeout,
    })))
}

/// Fewer replicas than [`RedisConfig::wait_replicas`] asked for
/// acknowledged a write within its timeout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "{acknowledged} of the {wanted} replica(s) asked for acknowledged the write within {timeout:?}"
)]
pub struct NotReplicated {
    /// Replicas asked for.
    pub wanted: u32,
    /// Replicas that acknowledged.
    pub acknowledged: i64,
    /// How long it waited.
    pub timeout: Duration,
}

/// What a server answers while it cannot take a write for now: loading its
/// data, its cluster or primary down, a replica (as the address of a
/// primary that failed over), out of memory under `noeviction`, a snapshot
/// it cannot save, too few replicas for `min-replicas-to-write`, a script
/// past its time limit.
const NOT_NOW: &[&str] = &[
    "LOADING",
    "MASTERDOWN",
    "CLUSTERDOWN",
    "TRYAGAIN",
    "READONLY",
    "OOM",
    "MISCONF",
    "NOREPLICAS",
    "BUSY",
];

/// Turns a Redis error into a store error: unreachable, timed out, dropped
/// or refused, or a server that cannot take a write for now (`LOADING`,
/// `READONLY`, `OOM`, `CLUSTERDOWN` and their kind), is
/// [`StoreError::Unavailable`]; the rest [`StoreError::Backend`].
pub fn store_error(e: redis::RedisError) -> StoreError {
    if e.is_io_error()
        || e.is_timeout()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_unrecoverable_error()
        || e.code().is_some_and(|code| NOT_NOW.contains(&code))
    {
        StoreError::Unavailable(Box::new(e))
    } else {
        StoreError::Backend(Box::new(e))
    }
}

impl RedisStore {
    /// Connects: to one server, with a connection manager that reconnects
    /// by itself; or to a cluster.
    ///
    /// On a cluster a prefix with `{` or `}` is refused: a record's key is
    /// `prefix:{hash}`, and Redis would hash a `{…}` in the prefix instead,
    /// putting every record in one slot, on one primary.
    pub async fn connect(config: RedisConfig) -> Result<Self, StoreError> {
        if config.cluster.is_some() && config.prefix.contains(['{', '}']) {
            return Err(StoreError::Backend(
                format!(
                    "the key prefix {:?} has a brace: on a Redis Cluster every record would hash to one slot (the prefix's {{…}}); choose one without",
                    config.prefix
                )
                .into(),
            ));
        }
        let conn = connection(&config).await?;
        let waiting = match config.wait_replicas {
            Some(wait) => Some(Waiting {
                wait,
                conn: connection(&config).await?,
            }),
            None => None,
        };
        Ok(Self {
            conn,
            waiting,
            cluster: config.cluster,
            timeout: config.timeout,
            prefix: config.prefix,
            claim: Script::new(scripts::CLAIM),
            complete: Script::new(scripts::COMPLETE),
            release: Script::new(scripts::RELEASE),
            cache_put: Script::new(scripts::CACHE_PUT),
        })
    }

    /// The Redis key of a record: `{prefix}:{<hex SHA-256 of scope and key>}`.
    pub fn record_key(&self, scope: &str, key: &str) -> String {
        let mut h = Sha256::new();
        h.update((scope.len() as u64).to_be_bytes());
        h.update(scope.as_bytes());
        h.update(key.as_bytes());
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let digest = h.finalize();
        let mut out = String::with_capacity(self.prefix.len() + 3 + 2 * digest.len());
        out.push_str(&self.prefix);
        out.push_str(":{");
        for b in digest {
            out.push(char::from(HEX[usize::from(b >> 4)]));
            out.push(char::from(HEX[usize::from(b & 0xf)]));
        }
        out.push('}');
        out
    }

    /// The key prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Runs `script` (its source) on `key` with `args`, then, with
    /// [`RedisConfig::wait_replicas`], `WAIT`. Both go in one pipeline on
    /// the connection kept for them: the `WAIT` counts the replicas that
    /// have this very write (a reconnect between two requests would have
    /// it count a fresh connection's nothing), and it never holds up the
    /// replays and reads on the main connection. On a cluster the pipeline
    /// goes to the primary of the key's slot (the script's key routes it;
    /// `WAIT` has none), and follows a redirection whole. The second value
    /// says whether enough replicas acknowledged.
    async fn write(
        &self,
        script: &Script,
        source: &str,
        key: &str,
        args: &[&[u8]],
    ) -> Result<(Value, Result<(), StoreError>), StoreError> {
        let Some(Waiting { wait, conn }) = &self.waiting else {
            let mut conn = self.conn.clone();
            let reply = eval_sha(&mut conn, script, source, key, args)
                .await
                .map_err(store_error)?;
            return Ok((reply, Ok(())));
        };
        let mut pipe = redis::pipe();
        pipe.add_command(script_command("EVAL", source, key, args))
            .add_command(wait_cmd(*wait));
        let mut conn = conn.clone();
        let (reply, acked): (Value, i64) =
            pipe.query_async(&mut conn).await.map_err(store_error)?;
        Ok((reply, acknowledged(*wait, acked)))
    }

    async fn claim_inner(&self, req: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        self.claim_as(req, FencingToken::generate(), OperationId::generate())
            .await
    }

    /// The claim of `req` under `token`, proposing `proposed` as the
    /// operation id: [`Store::claim`] with both chosen by the caller (the
    /// tests send one claim twice, as a lost reply would).
    async fn claim_as(
        &self,
        req: &ClaimRequest,
        token: FencingToken,
        proposed: OperationId,
    ) -> Result<ClaimOutcome, StoreError> {
        // Spelled on the stack (hyphenated, lowercase, as `to_string`
        // spells it): every request proposes one, replays included.
        let mut op = [0u8; uuid::fmt::Hyphenated::LENGTH];
        let op: &str = proposed.0.hyphenated().encode_lower(&mut op);
        // Past a century, a century (as on every store): the expiry is
        // added to the server's clock.
        let (lease, retention) = (
            idem_core::capped_millis(req.lease),
            idem_core::capped_millis(req.retention),
        );
        let key = self.record_key(&req.scope, &req.key);
        // The first look: plain commands in one round trip. A key that holds
        // nothing is claimed by it; a replay, or a duplicate of a live
        // claim, is answered by it; the claim script runs only for what it
        // alone can decide (a takeover, a record past its retention).
        let look = match self
            .first_look(&key, req, op, token, lease, retention)
            .await
        {
            Ok(look) => look,
            Err(e) => return Err(self.let_go(req, token, proposed, e).await),
        };
        let (record, now) = match look {
            FirstLook::Claimed(claim) => return Ok(ClaimOutcome::Acquired(claim)),
            FirstLook::Read(record, now) => (record, now),
            FirstLook::Hash => self.fetch_key(&key).await?,
        };
        // A claim under this very token is this request's first look sent
        // again (its reply lost): the claim script answers it as the claim
        // it is, not as a conflict with itself.
        let decides = |r: &Record| {
            first_look_decides(r, &req.fingerprint, now)
                && !matches!(r.state, RecordState::InProgress { token: t, .. } if t == token)
        };
        if let Some(record) = record.filter(decides) {
            return Ok(ClaimOutcome::Existing(record));
        }
        let (tok, lease, retention) = (
            token.0.to_string(),
            lease.to_string(),
            retention.to_string(),
        );
        let args: [&[u8]; 7] = [
            req.scope.as_bytes(),
            req.key.as_bytes(),
            req.fingerprint.as_bytes(),
            op.as_bytes(),
            tok.as_bytes(),
            lease.as_bytes(),
            retention.as_bytes(),
        ];
        let (reply, replicated) = match self.write(&self.claim, scripts::CLAIM, &key, &args).await {
            Ok(written) => written,
            Err(e) => return Err(self.let_go(req, token, proposed, e).await),
        };
        let Value::Array(reply) = reply else {
            return Err(StoreError::Corrupt(
                "unexpected reply from the claim script".into(),
            ));
        };
        let mut items = reply.iter();
        let outcome = match items.next().map(bytes_of) {
            Some(Some(b"won")) => {
                let op = text(items.next())?;
                let locked_until = number(items.next())?;
                let takeover = text(items.next())? == "1";
                ClaimOutcome::Acquired(Claim {
                    scope: req.scope.clone(),
                    key: req.key.clone(),
                    token,
                    operation_id: parse_op(&op)?,
                    locked_until: UnixMillis(locked_until),
                    takeover,
                })
            }
            Some(Some(b"existing")) => {
                let _now = number(items.next())?;
                let value = items.next().and_then(bytes_of).ok_or_else(|| {
                    StoreError::Corrupt("the claim script returned no record".into())
                })?;
                ClaimOutcome::Existing(value::decode(value, None)?)
            }
            _ => {
                return Err(StoreError::Corrupt(
                    "unexpected reply from the claim script".into(),
                ))
            }
        };
        if let (ClaimOutcome::Acquired(claim), Err(e)) = (&outcome, replicated) {
            // Not durable: the request must not run on it. Let it go at
            // once (best effort; the lease frees it otherwise).
            let _ = Store::release(self, claim).await;
            return Err(e);
        }
        Ok(outcome)
    }

    /// `e`, after letting go of the claim `token` may have made: a claim
    /// whose answer did not come back in time (a server slow for a moment,
    /// the answer lost) may still have been written, and would hold the
    /// key for its whole lease while the caller was told the store was
    /// unavailable and retries. The release is fenced by the token (it
    /// frees nothing else) and sent after the claim, on the same connection
    /// unless replicas are waited for (the claim then ran before its
    /// `WAIT`, which is what takes long); best effort: the lease frees the
    /// key otherwise.
    async fn let_go(
        &self,
        req: &ClaimRequest,
        token: FencingToken,
        proposed: OperationId,
        e: StoreError,
    ) -> StoreError {
        if matches!(e, StoreError::Unavailable(_)) {
            let claim = Claim {
                scope: req.scope.clone(),
                key: req.key.clone(),
                token,
                operation_id: proposed,
                locked_until: UnixMillis(0),
                takeover: false,
            };
            let _ = Store::release(self, &claim).await;
        }
        e
    }

    /// Reads a record and Redis's clock, expired records included.
    pub(crate) async fn fetch(
        &self,
        scope: &str,
        key: &str,
    ) -> Result<(Option<Record>, UnixMillis), StoreError> {
        self.fetch_key(&self.record_key(scope, key)).await
    }

    /// Reads the record at `key` and Redis's clock: plain commands (`GET`,
    /// `TIME`, `PEXPIRETIME`) in one pipeline, so one round trip and no
    /// script.
    /// On a cluster the pipeline goes to the primary of the key's slot (the
    /// one that runs the scripts), so the clock is the one they read. A
    /// record an earlier idem wrote as a hash is read with `HGETALL`.
    async fn fetch_key(&self, key: &str) -> Result<(Option<Record>, UnixMillis), StoreError> {
        // A hash can be rewritten as one value between the two reads: then
        // the value is read again (a value never turns back into a hash).
        match self.fetch_value(key).await? {
            Some(found) => Ok(found),
            None => match self.fetch_hash(key).await? {
                Some(found) => Ok(found),
                None => self.fetch_value(key).await?.ok_or_else(|| {
                    StoreError::Corrupt("a record is neither a value nor a hash".into())
                }),
            },
        }
    }

    /// The first look: one pipeline of plain commands, no script. `lease`
    /// and `retention` in ms.
    ///
    /// `SET key <claim> NX GET PX <life>` claims a key that holds nothing
    /// and, for one that holds a value, writes nothing and returns it: a
    /// read. `TIME` and `PEXPIRETIME` follow, so that a claim made this way
    /// (layout 2, whose times are counted from its key's expiry: it cannot
    /// read Redis's clock before it is written) is read on Redis's clock
    /// alone, to the millisecond the scripts read it. Nothing is stamped
    /// with this process's clock.
    ///
    /// A `SET` that Redis refuses (memory full under `noeviction`, too few
    /// replicas for `min-replicas-to-write`, a user who may only read) is
    /// followed by the plain read, so replays and duplicates are answered
    /// as before; the claim script meets the same refusal for what needs a
    /// claim. With [`RedisConfig::wait_replicas`] the look is the plain read
    /// alone: a claim must be followed by `WAIT` on the connection kept for
    /// writes, and a replay must not wait; the claim script claims.
    async fn first_look(
        &self,
        key: &str,
        req: &ClaimRequest,
        operation_id: &str,
        token: FencingToken,
        lease: i64,
        retention: i64,
    ) -> Result<FirstLook, StoreError> {
        if self.waiting.is_some() {
            return self.plain_look(key).await;
        }
        let claim = NewClaim::new(
            &req.scope,
            &req.key,
            req.fingerprint.as_bytes(),
            operation_id,
            token.0,
            lease,
            retention,
        );
        // Made with room for its arguments (a TTL is at most 20 digits),
        // as are the pipeline's other commands: nothing grows as it is
        // written, on the path every request takes.
        let mut set = redis::Cmd::with_capacity(7, key.len() + claim.value.len() + 32);
        set.arg("SET")
            .arg(key)
            .arg(&claim.value)
            .arg("NX")
            .arg("GET")
            .arg("PX")
            .arg(claim.ttl);
        let (value, clock) = self.read_with_clock(set, key).await?;
        match value {
            Value::Nil => {
                if clock.expires < 0 {
                    // Deleted, or stripped of its expiry, between the two
                    // commands: not a claim anyone can count on.
                    return Err(StoreError::Backend(
                        "the claim just made was gone before its expiry was read".into(),
                    ));
                }
                let made = value::decode(&claim.value, Some(clock))?;
                let RecordState::InProgress { locked_until, .. } = made.state else {
                    return Err(StoreError::Corrupt("a claim reads as completed".into()));
                };
                Ok(FirstLook::Claimed(Claim {
                    scope: req.scope.clone(),
                    key: req.key.clone(),
                    token,
                    operation_id: made.operation_id,
                    locked_until,
                    takeover: false,
                }))
            }
            Value::ServerError(e) if e.code() != "WRONGTYPE" => self.plain_look(key).await,
            value => Ok(match read_reply(value, clock)? {
                Some(record) => FirstLook::Read(record, UnixMillis(clock.now)),
                None => FirstLook::Hash,
            }),
        }
    }

    /// The first look as a plain read: `GET`, `TIME`, `PEXPIRETIME`.
    async fn plain_look(&self, key: &str) -> Result<FirstLook, StoreError> {
        Ok(match self.fetch_value(key).await? {
            Some((record, now)) => FirstLook::Read(record, now),
            None => FirstLook::Hash,
        })
    }

    /// `read` (a command on `key`), `TIME` and `PEXPIRETIME` in one
    /// pipeline, the read's errors kept in place (so that a WRONGTYPE is
    /// told apart from a failure): the read's reply, and Redis's clock with
    /// the key's expiry.
    async fn read_with_clock(
        &self,
        read: redis::Cmd,
        key: &str,
    ) -> Result<(Value, KeyClock), StoreError> {
        let mut time = redis::Cmd::with_capacity(1, 4);
        time.arg("TIME");
        let mut expires = redis::Cmd::with_capacity(2, 11 + key.len());
        expires.arg("PEXPIRETIME").arg(key);
        let mut pipe = redis::Pipeline::with_capacity(3);
        pipe.add_command(read)
            .add_command(time)
            .add_command(expires)
            .ignore_errors();
        let mut conn = self.conn.clone();
        let reply: Value = pipe.query_async(&mut conn).await.map_err(store_error)?;
        let unexpected =
            || StoreError::Corrupt("unexpected reply to a read, TIME and PEXPIRETIME".into());
        let Value::Array(replies) = reply else {
            return Err(unexpected());
        };
        let [value, time, expires] = <[Value; 3]>::try_from(replies).map_err(|_| unexpected())?;
        let expires = match expires {
            Value::Int(n) => n,
            Value::ServerError(e) => return Err(store_error(e.into())),
            _ => return Err(unexpected()),
        };
        if let Value::ServerError(e) = time {
            return Err(store_error(e.into()));
        }
        let now = redis_time(&time)?.0;
        Ok((value, KeyClock { now, expires }))
    }

    /// `GET`, `TIME` and `PEXPIRETIME`; `None` if the key holds a hash.
    async fn fetch_value(
        &self,
        key: &str,
    ) -> Result<Option<(Option<Record>, UnixMillis)>, StoreError> {
        let mut get = redis::Cmd::with_capacity(2, 3 + key.len());
        get.arg("GET").arg(key);
        let (value, clock) = self.read_with_clock(get, key).await?;
        Ok(read_reply(value, clock)?.map(|record| (record, UnixMillis(clock.now))))
    }

    /// [`Self::fetch_key`] for a record in the layout before one value: a
    /// hash, read whole; `None` if the key holds a value by now.
    async fn fetch_hash(
        &self,
        key: &str,
    ) -> Result<Option<(Option<Record>, UnixMillis)>, StoreError> {
        let mut hgetall = redis::cmd("HGETALL");
        hgetall.arg(key);
        let (fields, clock) = self.read_with_clock(hgetall, key).await?;
        let now = UnixMillis(clock.now);
        let record = match fields {
            Value::Array(fields) if fields.is_empty() => None,
            Value::Array(fields) => Some(decode(&fields)?),
            Value::Map(pairs) if pairs.is_empty() => None,
            Value::Map(pairs) => {
                let flat: Vec<Value> = pairs.into_iter().flat_map(|(k, v)| [k, v]).collect();
                Some(decode(&flat)?)
            }
            Value::Nil => None,
            Value::ServerError(e) if e.code() == "WRONGTYPE" => return Ok(None),
            Value::ServerError(e) => return Err(store_error(e.into())),
            _ => return Err(StoreError::Corrupt("unexpected reply to HGETALL".into())),
        };
        Ok(Some((record, now)))
    }

    /// Caches a completed record until it expires (tiered mode). Never
    /// overwrites a completed record.
    pub(crate) async fn cache_completed(&self, record: &Record) -> Result<(), StoreError> {
        let Some(value) = value::encode_record(record) else {
            return Ok(());
        };
        let mut conn = self.conn.clone();
        let key = self.record_key(&record.scope, &record.key);
        let mut expires = itoa::Buffer::new();
        let args: [&[u8]; 2] = [&value, expires.format(record.expires_at.0).as_bytes()];
        match eval_sha(&mut conn, &self.cache_put, scripts::CACHE_PUT, &key, &args)
            .await
            .map_err(store_error)?
        {
            Value::Int(_) => Ok(()),
            _ => Err(StoreError::Corrupt(
                "unexpected reply from the cache script".into(),
            )),
        }
    }
}

/// Runs `script` (whose source is `source`) on `key` with `args` by its
/// hash (`EVALSHA`), in a command made with room for them all. A server
/// that does not know the script (`NOSCRIPT`: restarted, failed over, or
/// told `SCRIPT FLUSH`) gets its source (`EVAL`), which runs it and keeps it
/// for the next `EVALSHA`: one command, so no flush can come between the
/// script's loading and its run. (redis-rs's invocation loads, then runs,
/// and first copies every argument into a buffer of its own: an allocation
/// each, the response's body included.)
async fn eval_sha(
    conn: &mut impl redis::aio::ConnectionLike,
    script: &Script,
    source: &str,
    key: &str,
    args: &[&[u8]],
) -> redis::RedisResult<Value> {
    let by_hash = script_command("EVALSHA", script.get_hash(), key, args);
    match by_hash.query_async(conn).await {
        Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
            script_command("EVAL", source, key, args)
                .query_async(conn)
                .await
        }
        answered => answered,
    }
}

/// `EVAL` or `EVALSHA` (`name`) of `script` (its source or hash) on `key`
/// with `args`, made with room for every argument's bytes (their lengths
/// and CRLFs are counted as the command is written).
fn script_command(name: &str, script: &str, key: &str, args: &[&[u8]]) -> redis::Cmd {
    let bytes = name.len() + script.len() + 1 + key.len();
    let bytes = bytes + args.iter().map(|a| a.len()).sum::<usize>();
    let mut cmd = redis::Cmd::with_capacity(4 + args.len(), bytes);
    cmd.arg(name).arg(script).arg(1).arg(key);
    for a in args {
        cmd.arg(*a);
    }
    cmd
}

/// A record read as one value, by the clock read with it: `Some(None)` if
/// the key holds nothing (or was gone by the time its expiry was read: it
/// expired, or was deleted, in between); `None` if it holds a hash (the
/// layout before one value).
fn read_reply(value: Value, clock: KeyClock) -> Result<Option<Option<Record>>, StoreError> {
    match value {
        Value::Nil => Ok(Some(None)),
        Value::BulkString(_) if clock.expires == -2 => Ok(Some(None)),
        Value::BulkString(b) => Ok(Some(Some(value::decode_owned(b, Some(clock))?))),
        Value::ServerError(e) if e.code() == "WRONGTYPE" => Ok(None),
        Value::ServerError(e) => Err(store_error(e.into())),
        _ => Err(StoreError::Corrupt("unexpected reply to a read".into())),
    }
}

/// What the first look found.
enum FirstLook {
    /// The key held nothing: the claim it made.
    Claimed(Claim),
    /// The record under the key, or none, and Redis's clock.
    Read(Option<Record>, UnixMillis),
    /// A record in the layout before one value (a hash), read apart.
    Hash,
}

/// Whether the record the first look read answers a claim with
/// `fingerprint` at `now` (Redis's clock) exactly as the claim script would
/// have at that instant, with no write: a record within its retention that
/// no takeover may take (completed; or in progress under a live lease; or
/// under a lapsed lease of another request's body). The rest, a record past
/// its retention or a lapsed lease of this very request, goes to the script.
fn first_look_decides(record: &Record, fingerprint: &Fingerprint, now: UnixMillis) -> bool {
    if record.is_expired(now) {
        return false;
    }
    match &record.state {
        RecordState::Completed { .. } => true,
        RecordState::InProgress { locked_until, .. } => {
            *locked_until > now || record.fingerprint != *fingerprint
        }
    }
}

impl Store for RedisStore {
    fn kind(&self) -> &'static str {
        "redis"
    }

    fn claim<'a>(
        &'a self,
        request: &'a ClaimRequest,
    ) -> BoxFuture<'a, Result<ClaimOutcome, StoreError>> {
        Box::pin(self.claim_inner(request))
    }

    fn complete<'a>(
        &'a self,
        claim: &'a Claim,
        response: &'a StoredResponse,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            let (mut tok, mut status) = (itoa::Buffer::new(), itoa::Buffer::new());
            let headers = response.encode_headers();
            let args: [&[u8]; 4] = [
                tok.format(claim.token.0).as_bytes(),
                status.format(response.status).as_bytes(),
                &headers,
                response.body.as_ref(),
            ];
            let key = self.record_key(&claim.scope, &claim.key);
            let (done, replicated) = self
                .write(&self.complete, scripts::COMPLETE, &key, &args)
                .await?;
            match done {
                Value::Int(1) => replicated,
                Value::Int(_) => Err(StoreError::ClaimLost),
                _ => Err(StoreError::Corrupt(
                    "unexpected reply from the complete script".into(),
                )),
            }
        })
    }

    fn release<'a>(&'a self, claim: &'a Claim) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            let mut conn = self.conn.clone();
            let mut tok = itoa::Buffer::new();
            let key = self.record_key(&claim.scope, &claim.key);
            let args: [&[u8]; 1] = [tok.format(claim.token.0).as_bytes()];
            let done = eval_sha(&mut conn, &self.release, scripts::RELEASE, &key, &args)
                .await
                .map_err(store_error)?;
            match done {
                Value::Int(1) => Ok(()),
                Value::Int(_) => Err(StoreError::ClaimLost),
                _ => Err(StoreError::Corrupt(
                    "unexpected reply from the release script".into(),
                )),
            }
        })
    }

    fn get<'a>(
        &'a self,
        scope: &'a str,
        key: &'a str,
    ) -> BoxFuture<'a, Result<Option<Record>, StoreError>> {
        Box::pin(async move {
            let (record, now) = self.fetch(scope, key).await?;
            Ok(record.filter(|r| !r.is_expired(now)))
        })
    }

    /// Redis expires records by itself (`PEXPIREAT` at the end of their
    /// retention, or of a live lease if later): nothing is left to sweep.
    fn sweep(&self, _batch: usize) -> BoxFuture<'_, Result<u64, StoreError>> {
        Box::pin(async { Ok(0) })
    }
}

#[cfg(test)]
mod tests;
