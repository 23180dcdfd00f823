//! Names read back from a saved report: a report holds its drop reasons and blind spot kinds as
//! `&'static str` (memprof's own constants), so a recording's copies are kept once each for the
//! rest of the run: a handful of short names, however many reports name them.

use std::{
    collections::{BTreeMap, HashSet},
    sync::{LazyLock, Mutex},
};

use serde::{Deserialize, Deserializer};

static NAMES: LazyLock<Mutex<HashSet<&'static str>>> = LazyLock::new(Mutex::default);

/// The one `'static` copy of `name`.
pub fn intern(name: String) -> &'static str {
    let mut names = NAMES.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(known) = names.get(name.as_str()) {
        return known;
    }
    let kept: &'static str = Box::leak(name.into_boxed_str());
    names.insert(kept);
    kept
}

pub fn deserialize_counts<'de, D: Deserializer<'de>>(deserializer: D) -> Result<BTreeMap<&'static str, u64>, D::Error> {
    let counts = BTreeMap::<String, u64>::deserialize(deserializer)?;
    Ok(counts.into_iter().map(|(name, count)| (intern(name), count)).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_is_kept_once() {
        let (a, b) = (intern("live_map_full".into()), intern("live_map_full".into()));
        assert!(std::ptr::eq(a, b));
    }
}
