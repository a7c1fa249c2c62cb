//! [`Fleet`]: the `shop` processes of one mode, restarted when they die,
//! for the history checkers.

use std::sync::{Arc, Mutex};

use super::{start_routed, Db, Mode, RedisPrefix, Route, Shop};

/// The `shop` processes of one mode on one database, restarted when they
/// die (a simulated crash, a `kill -9`).
pub struct Fleet {
    // Fields drop in order: the processes go before their database.
    slots: tokio::sync::Mutex<Vec<Shop>>,
    pub mode: Mode,
    pub db: Db,
    pub prefix: RedisPrefix,
    flags: Vec<String>,
    route: Route,
    bases: Mutex<Vec<String>>,
    pub kills: Mutex<u64>,
    pub restarts: Mutex<u64>,
}

impl Fleet {
    /// `processes` shops in `mode` with `flags`, on a database of their own.
    pub async fn start(mode: Mode, test: &str, processes: usize, flags: &[&str]) -> Arc<Fleet> {
        let db = mode.db().await;
        let route = Route::direct(&db);
        Self::start_routed(mode, db, route, test, processes, flags).await
    }

    /// `processes` shops in `mode` with `flags` on `db`, reaching their
    /// servers by `route` (through fault proxies, say).
    pub async fn start_routed(
        mode: Mode,
        db: Db,
        route: Route,
        test: &str,
        processes: usize,
        flags: &[&str],
    ) -> Arc<Fleet> {
        let prefix = RedisPrefix::new(test);
        let flags: Vec<String> = flags.iter().map(|s| (*s).to_owned()).collect();
        let mut slots = Vec::new();
        for _ in 0..processes {
            slots.push(Self::spawn(mode, &route, &prefix, &flags).await);
        }
        let bases = slots.iter().map(|s| s.base.clone()).collect();
        Arc::new(Fleet {
            mode,
            db,
            prefix,
            flags,
            route,
            slots: tokio::sync::Mutex::new(slots),
            bases: Mutex::new(bases),
            kills: Mutex::new(0),
            restarts: Mutex::new(0),
        })
    }

    async fn spawn(mode: Mode, route: &Route, prefix: &RedisPrefix, flags: &[String]) -> Shop {
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        start_routed(mode, route, &prefix.0, &flags).await
    }

    /// The base URL of one live process, picked by `pick`.
    pub fn base(&self, pick: u64) -> Option<String> {
        let bases = self.bases.lock().unwrap();
        if bases.is_empty() {
            return None;
        }
        Some(bases[(pick % bases.len() as u64) as usize].clone())
    }

    /// The base URLs of the live processes.
    pub fn bases(&self) -> Vec<String> {
        self.bases.lock().unwrap().clone()
    }

    /// Restarts every process that died; `kill` one first, if asked.
    pub async fn tend(&self, kill: Option<usize>) {
        let mut slots = self.slots.lock().await;
        if let Some(i) = kill {
            let i = i % slots.len();
            slots[i].kill9();
            *self.kills.lock().unwrap() += 1;
        }
        let mut changed = kill.is_some();
        for i in 0..slots.len() {
            if slots[i].exited() {
                changed = true;
                self.bases.lock().unwrap().retain(|b| *b != slots[i].base);
                slots[i] = Self::spawn(self.mode, &self.route, &self.prefix, &self.flags).await;
                *self.restarts.lock().unwrap() += 1;
            }
        }
        if changed {
            *self.bases.lock().unwrap() = slots.iter().map(|s| s.base.clone()).collect();
        }
    }
}
