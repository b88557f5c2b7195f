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

/// The candidate closest to `word`, when it is close enough to be a likely misspelling (at most
/// a third of `word`'s length apart, and at most 4 edits); ties go to the first.
pub(crate) fn closest<'a>(word: &str, candidates: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    let limit = (word.len() / 3).clamp(1, 4);
    candidates
        .into_iter()
        .map(|c| (distance(word, c), c))
        .filter(|(d, _)| *d <= limit)
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_closest_known_key_is_suggested_and_far_ones_are_not() {
        let keys = ["hixl.streams", "hixl.tcp.streams", "hixl.queue_depth", "hixl.secret"];
        assert_eq!(closest("hixl.stream", keys), Some("hixl.streams"));
        assert_eq!(closest("HIXL.QUEUE-DEPTH", keys), Some("hixl.queue_depth"));
        assert_eq!(closest("hixl.tcp.stream", keys), Some("hixl.tcp.streams"));
        assert_eq!(closest("hixl.nope", keys), None);
        assert_eq!(distance("kitten", "sitting"), 3);
        assert_eq!(distance("", "abc"), 3);
    }
}
