//! The `glob` tool's matcher: the `glob` crate's pattern language, with its
//! `require_literal_separator` option (`*`, `?` and classes never match `/`; `**` as a whole
//! path component matches any number of directories), compiled to a [`regex::Regex`].
//!
//! The `glob` crate matches by backtracking, and with that option a `*` stopped by a `/` gives
//! up only its own branch: a pattern such as `*?*?*?*?*?*?/z` costs exponentially in the
//! length of a directory name, on a thread nothing can interrupt. A regex matches in time
//! linear in the path. Patterns are parsed by the `glob` crate first, so what it refuses (and
//! how it says so) stays as it was.

use regex::Regex;

/// One element of a pattern, as the `glob` crate reads it.
#[derive(Debug, PartialEq)]
enum Token {
    Char(char),
    /// `?`
    AnyChar,
    /// `*`
    AnySequence,
    /// `**` as a whole path component (with the `/` after it, if any).
    AnyRecursiveSequence,
    /// `[…]`
    AnyWithin(Vec<Specifier>),
    /// `[!…]`
    AnyExcept(Vec<Specifier>),
}

#[derive(Debug, PartialEq)]
enum Specifier {
    Single(char),
    Range(char, char),
}

/// A compiled glob (see the module documentation).
#[derive(Debug)]
pub(crate) struct GlobMatcher(Regex);

impl GlobMatcher {
    /// `pattern` compiled; the `glob` crate's message when it refuses the pattern.
    pub(crate) fn new(pattern: &str) -> Result<Self, String> {
        glob::Pattern::new(pattern).map_err(|error| error.to_string())?;
        let mut regex = String::from("(?s)^");
        let tokens = tokens(pattern);
        for (index, token) in tokens.iter().enumerate() {
            match token {
                Token::Char(c) => regex.push_str(&regex::escape(c.encode_utf8(&mut [0; 4]))),
                Token::AnyChar => regex.push_str("[^/]"),
                Token::AnySequence => regex.push_str("[^/]*"),
                // Last, it matches whatever is left; elsewhere, nothing or a run of whole
                // directories (what ends in a `/`).
                Token::AnyRecursiveSequence if index + 1 == tokens.len() => regex.push_str(".*"),
                Token::AnyRecursiveSequence => regex.push_str("(?:.*/)?"),
                Token::AnyWithin(specifiers) => {
                    regex.push_str("[[");
                    if !push_specifiers(&mut regex, specifiers) {
                        // An empty class: `[a&&b]` matches nothing.
                        regex.push_str("a&&b");
                    }
                    regex.push_str("]&&[^/]]");
                }
                Token::AnyExcept(specifiers) => {
                    regex.push_str("[^/");
                    push_specifiers(&mut regex, specifiers);
                    regex.push(']');
                }
            }
        }
        regex.push('$');
        regex::RegexBuilder::new(&regex)
            .size_limit(1 << 22)
            .build()
            .map(Self)
            .map_err(|error| format!("the pattern is too large to match ({error})"))
    }

    /// Whether `path` matches the whole pattern.
    pub(crate) fn matches(&self, path: &str) -> bool {
        self.0.is_match(path)
    }
}

/// The class members `specifiers` as regex class text: each character escaped, a range whose
/// ends are reversed left out (it matches nothing). Whether any member was written.
fn push_specifiers(regex: &mut String, specifiers: &[Specifier]) -> bool {
    let mut any = false;
    for specifier in specifiers {
        match *specifier {
            Specifier::Single(c) => {
                regex.push_str(&format!("\\x{{{:X}}}", u32::from(c)));
                any = true;
            }
            Specifier::Range(start, end) if start <= end => {
                regex.push_str(&format!("\\x{{{:X}}}-\\x{{{:X}}}", u32::from(start), u32::from(end)));
                any = true;
            }
            Specifier::Range(..) => {}
        }
    }
    any
}

/// `pattern`'s tokens, read as the `glob` crate reads a pattern it accepts.
fn tokens(pattern: &str) -> Vec<Token> {
    let chars: Vec<char> = pattern.chars().collect();
    let mut tokens = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        match chars[i] {
            '?' => {
                tokens.push(Token::AnyChar);
                i += 1;
            }
            '*' => {
                let start = i;
                while i < chars.len() && chars[i] == '*' {
                    i += 1;
                }
                if i - start == 2 {
                    // Accepted only as a whole component: the `/` after it goes with it.
                    if i < chars.len() && chars[i] == '/' {
                        i += 1;
                    }
                    // Consecutive ones are one (after a first token, as the crate has it).
                    if !(tokens.len() > 1 && tokens.last() == Some(&Token::AnyRecursiveSequence)) {
                        tokens.push(Token::AnyRecursiveSequence);
                    }
                } else {
                    tokens.push(Token::AnySequence);
                }
            }
            '[' => {
                // The crate accepted it: the class closes.
                if i + 4 <= chars.len()
                    && chars[i + 1] == '!'
                    && let Some(j) = chars[i + 3..].iter().position(|c| *c == ']')
                {
                    tokens.push(Token::AnyExcept(specifiers(&chars[i + 2..i + 3 + j])));
                    i += j + 4;
                } else if let Some(j) = chars.get(i + 2..).and_then(|rest| rest.iter().position(|c| *c == ']')) {
                    tokens.push(Token::AnyWithin(specifiers(&chars[i + 1..i + 2 + j])));
                    i += j + 3;
                } else {
                    // Unreachable for an accepted pattern; matched as itself.
                    tokens.push(Token::Char('['));
                    i += 1;
                }
            }
            c => {
                tokens.push(Token::Char(c));
                i += 1;
            }
        }
    }
    tokens
}

fn specifiers(chars: &[char]) -> Vec<Specifier> {
    let mut specifiers = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        if i + 3 <= chars.len() && chars[i + 1] == '-' {
            specifiers.push(Specifier::Range(chars[i], chars[i + 2]));
            i += 3;
        } else {
            specifiers.push(Specifier::Single(chars[i]));
            i += 1;
        }
    }
    specifiers
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests assert by unwrapping
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn crate_matches(pattern: &str, path: &str) -> bool {
        let options = glob::MatchOptions {
            require_literal_separator: true,
            ..glob::MatchOptions::default()
        };
        glob::Pattern::new(pattern).unwrap().matches_with(path, options)
    }

    #[test]
    fn common_patterns_match_as_the_glob_crate_matches_them() {
        let paths = [
            "README.md",
            "src/main.rs",
            "src/sandbox/tools.rs",
            "docs/a/b/c.md",
            ".hidden/x.md",
            "a/b",
            "ab",
            "a]b",
            "a-b/c!d.txt",
            "é/ü.rs",
            "a\nb",
        ];
        let patterns = [
            "*.md",
            "**/*.md",
            "src/*.rs",
            "src/**/*.rs",
            "**",
            "**/",
            "a/**",
            "**/b",
            "?",
            "??",
            "a?b",
            "[ab]*",
            "[!a]*",
            "[]]*",
            "[!]]*",
            "a[]]b",
            "[a-c]/*",
            "[z-a]*",
            "*/*/*/*.md",
            "a-b/c[!x]d.*",
            "é/*",
            "a?b",
            "a*b",
            "**/**/*.rs",
            "a/**/**/b",
        ];
        for pattern in patterns {
            let matcher = GlobMatcher::new(pattern).unwrap();
            for path in paths {
                assert_eq!(
                    matcher.matches(path),
                    crate_matches(pattern, path),
                    "{pattern:?} against {path:?}"
                );
            }
        }
    }

    #[test]
    fn a_pattern_the_glob_crate_refuses_is_refused_with_its_message() {
        for pattern in ["a**", "***", "**b", "[", "[a", "[!a"] {
            let refused = GlobMatcher::new(pattern).unwrap_err();
            assert_eq!(
                refused,
                glob::Pattern::new(pattern).unwrap_err().to_string(),
                "{pattern}"
            );
        }
    }

    /// The pattern that costs the `glob` crate exponential time in a directory name's length
    /// is matched at once.
    #[test]
    fn a_pattern_with_many_wildcards_matches_in_linear_time() {
        let pattern = format!("{}/z", "*?".repeat(40));
        let matcher = GlobMatcher::new(&pattern).unwrap();
        let directory = "d".repeat(200);
        assert!(!matcher.matches(&format!("{directory}/y")));
        assert!(matcher.matches(&format!("{directory}/z")));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        /// Any pattern the crate accepts, over short paths of a small alphabet (where the
        /// crate's backtracking stays cheap), matches as the crate matches it.
        #[test]
        fn random_patterns_match_as_the_glob_crate_matches_them(
            parts in proptest::collection::vec(
                prop_oneof![
                    Just("a"), Just("b"), Just("/"), Just("*"), Just("**"), Just("?"),
                    Just("[ab]"), Just("[!a]"), Just("[a-b]"), Just("[b-a]"), Just("]"), Just("-"),
                ],
                0..7,
            ),
            paths in proptest::collection::vec("[ab/\\-\\]]{0,7}", 1..8),
        ) {
            let pattern: String = parts.concat();
            if glob::Pattern::new(&pattern).is_ok() {
                let matcher = GlobMatcher::new(&pattern).unwrap();
                for path in &paths {
                    prop_assert_eq!(
                        matcher.matches(path),
                        crate_matches(&pattern, path),
                        "{:?} against {:?}",
                        pattern,
                        path
                    );
                }
            }
        }
    }
}
