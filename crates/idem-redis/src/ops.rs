//! What operators do: forget a record's Redis side, peek at one, count and
//! clear the prefix's keys, on every node of a cluster.

use idem_core::{Claim, Fingerprint, Record, StoreError, UnixMillis};
use redis::aio::ConnectionManagerConfig;

use crate::conn::{node_url, scan, Conn, Single};
use crate::{store_error, value, RedisStore};

impl RedisStore {
    /// Drops what Redis holds for a record in tiered mode (a cached
    /// completion or an in-flight marker), so that the next request asks
    /// the SQL store: for operators releasing a claim.
    pub async fn forget(&self, scope: &str, key: &str) -> Result<(), StoreError> {
        let mut conn = self.conn.clone();
        let _: i64 = redis::cmd("DEL")
            .arg(self.record_key(scope, key))
            .query_async(&mut conn)
            .await
            .map_err(store_error)?;
        Ok(())
    }

    /// Withdraws `claim`, which did nothing (its request turned out not to
    /// be the key's: the application bound the key to another request
    /// where its effects live): the record is deleted if it is still in
    /// progress under the claim's token, so the key is free for any
    /// request, as if never claimed. A release would keep the record, and
    /// with it this request's fingerprint, refusing the key's own request
    /// (`422`) until the retention ends. Whether it was withdrawn.
    pub async fn withdraw(&self, claim: &Claim) -> Result<bool, StoreError> {
        let script = redis::Script::new(crate::scripts::WITHDRAW);
        let mut conn = self.conn.clone();
        let mut tok = itoa::Buffer::new();
        let key = self.record_key(&claim.scope, &claim.key);
        let args: [&[u8]; 1] = [tok.format(claim.token.0).as_bytes()];
        let done = crate::eval_sha(&mut conn, &script, crate::scripts::WITHDRAW, &key, &args)
            .await
            .map_err(store_error)?;
        match done {
            redis::Value::Int(n) => Ok(n == 1),
            _ => Err(StoreError::Corrupt(
                "unexpected reply from the withdraw script".into(),
            )),
        }
    }

    /// Writes an in-flight marker for a claim decided elsewhere (tiered
    /// mode), expiring with its lease: one plain `SET`, which replaces
    /// whatever the key held.
    pub(crate) async fn mark_in_flight(
        &self,
        claim: &Claim,
        fingerprint: &Fingerprint,
    ) -> Result<(), StoreError> {
        let op = claim.operation_id.0.to_string();
        let marker = value::encode(&value::Parts {
            scope: &claim.scope,
            key: &claim.key,
            fingerprint: fingerprint.as_bytes(),
            operation_id: &op,
            token: claim.token.0,
            completed: false,
            locked_until: claim.locked_until.0,
            created_at: 0,
            expires_at: claim.locked_until.0,
            completed_at: 0,
            status: 0,
            headers: b"",
            body: b"",
            shortest_retention: None,
        });
        let mut conn = self.conn.clone();
        let () = redis::cmd("SET")
            .arg(self.record_key(&claim.scope, &claim.key))
            .arg(marker)
            .arg("PXAT")
            .arg(claim.locked_until.0)
            .query_async(&mut conn)
            .await
            .map_err(store_error)?;
        Ok(())
    }

    /// What Redis holds for a record (expired or not), with Redis's clock:
    /// for operators looking at a tier.
    pub async fn peek(
        &self,
        scope: &str,
        key: &str,
    ) -> Result<(Option<Record>, UnixMillis), StoreError> {
        self.fetch(scope, key).await
    }

    /// How many keys live under this store's prefix (operators). On a
    /// cluster, every primary is scanned.
    pub async fn count_keys(&self) -> Result<u64, StoreError> {
        let mut count = 0;
        for mut node in self.nodes().await? {
            count += scan(&mut node, &self.prefix, false).await?;
        }
        Ok(count)
    }

    /// Deletes every key under this store's prefix (tests, operators). On a
    /// cluster, every primary is scanned.
    pub async fn clear(&self) -> Result<u64, StoreError> {
        let mut deleted = 0;
        for mut node in self.nodes().await? {
            deleted += scan(&mut node, &self.prefix, true).await?;
        }
        Ok(deleted)
    }

    /// A connection to each server that holds keys: the one server, or
    /// each primary of the cluster.
    async fn nodes(&self) -> Result<Vec<Conn>, StoreError> {
        let Some(seeds) = &self.cluster else {
            return Ok(vec![self.conn.clone()]);
        };
        let mut conn = self.conn.clone();
        let listing: String = redis::cmd("CLUSTER")
            .arg("NODES")
            .query_async(&mut conn)
            .await
            .map_err(store_error)?;
        let seed = seeds.first().map(String::as_str).unwrap_or("redis://");
        let mut nodes = Vec::new();
        for line in listing.lines() {
            let mut fields = line.split_whitespace();
            let (Some(_id), Some(addr), Some(flags)) =
                (fields.next(), fields.next(), fields.next())
            else {
                continue;
            };
            let flags: Vec<&str> = flags.split(',').collect();
            if !flags.contains(&"master") {
                continue;
            }
            let addr = addr.split('@').next().unwrap_or(addr);
            // A primary that is down (or has no address) would be skipped
            // silently: say so instead, so a count or a clear is never
            // reported whole when it is not.
            if flags.contains(&"fail") || flags.contains(&"noaddr") || addr.starts_with(':') {
                return Err(StoreError::Unavailable(
                    format!("the cluster's primary {addr} is not reachable").into(),
                ));
            }
            // An IPv6 host is written bare in CLUSTER NODES; a URL brackets it.
            let addr = match addr.rsplit_once(':') {
                Some((host, port)) if host.contains(':') => format!("[{host}]:{port}"),
                _ => addr.to_owned(),
            };
            let addr = addr.as_str();
            let client = redis::Client::open(node_url(seed, addr).as_str())
                .map_err(|e| StoreError::Backend(Box::new(e)))?;
            let manager = ConnectionManagerConfig::new()
                .set_response_timeout(Some(self.timeout))
                .set_connection_timeout(Some(self.timeout))
                .set_number_of_retries(1);
            nodes.push(Conn::Single(
                Single::connect(client, manager)
                    .await
                    .map_err(store_error)?,
            ));
        }
        Ok(nodes)
    }
}
