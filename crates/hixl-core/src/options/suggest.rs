//! "Did you mean": the known name closest to a misspelt one.

/// Edit distance (insertions, deletions, substitutions) between `a` and `b`, ASCII case
/// folded.
fn distance(a: &str, b: &str) -> usize {
    let (a, b) = (a.to_ascii_lowercase().into_bytes(), b.to_ascii_lowercase().into_bytes());
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.iter().enumerate() {
        let mut diag = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let next = (diag + usize::from(ca != cb)).min(row[j] + 1).min(row[j + 1] + 1);
            diag = row[j + 1];
            row[j + 1] = next;
        }
    }
    row[b.len()]
}

/// The last dotted segment of a key (`streams` of `hixl.tcp.streams`), ASCII case folded.
fn leaf(key: &str) -> String {
    key.rsplit('.').next().unwrap_or(key).to_ascii_lowercase()
}

/// The candidate closest to `word`, when it is close enough to be a likely misspelling (at most
/// a third of `word`'s length apart, and at most 4 edits). Among the equally close, one that
/// ends in `word`'s last segment goes first (`hixl.streams`: `hixl.tcp.streams`, a backend's
/// key given without its backend, before `hixl.max_streams`); then the first.
pub(crate) fn closest<'a>(word: &str, candidates: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    let limit = (word.len() / 3).clamp(1, 4);
    let word_leaf = leaf(word);
    candidates
        .into_iter()
        .map(|c| (distance(word, c), leaf(c) != word_leaf, c))
        .filter(|(d, _, _)| *d <= limit)
        .min_by_key(|(d, other_leaf, _)| (*d, *other_leaf))
        .map(|(_, _, c)| c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_closest_known_key_is_suggested_and_far_ones_are_not() {
        let keys = ["hixl.max_streams", "hixl.tcp.streams", "hixl.queue_depth", "hixl.secret"];
        assert_eq!(closest("hixl.max_stream", keys), Some("hixl.max_streams"));
        assert_eq!(closest("HIXL.QUEUE-DEPTH", keys), Some("hixl.queue_depth"));
        assert_eq!(closest("hixl.tcp.stream", keys), Some("hixl.tcp.streams"));
        assert_eq!(closest("hixl.nope", keys), None);
        // Both 4 edits away: the one with the same last segment wins, in either order.
        assert_eq!(closest("hixl.streams", keys), Some("hixl.tcp.streams"));
        assert_eq!(
            closest("hixl.streams", ["hixl.tcp.streams", "hixl.max_streams"]),
            Some("hixl.tcp.streams")
        );
        assert_eq!(distance("kitten", "sitting"), 3);
        assert_eq!(distance("", "abc"), 3);
    }
}
