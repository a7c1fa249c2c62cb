//! Unit tests of the conditional-request helpers.
use super::*;

fn headers(name: header::HeaderName, values: &[&str]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for v in values {
        h.append(name.clone(), v.parse().unwrap());
    }
    h
}

fn if_match(values: &[&str]) -> Result<Option<IfMatch>, String> {
    parse_list(&headers(header::IF_MATCH, values), &header::IF_MATCH).map(|o| o.map(IfMatch))
}

#[test]
fn etags_are_strong_and_quoted() {
    let t = ETag::from_version(42);
    assert_eq!(t.to_string(), "\"42\"");
    assert_eq!(t.header_value(), "\"42\"");
    assert_eq!(t.version(), Some(42));
    assert!(ETag::new("a\"b").is_none());
}

#[test]
fn if_match_parsing_and_strong_comparison() {
    let v3 = ETag::from_version(3);
    assert_eq!(if_match(&[]).unwrap(), None);
    let m = if_match(&["\"3\""]).unwrap().unwrap();
    assert!(m.matches(Some(&v3)));
    assert_eq!(m.version(), Some(3));
    assert!(!m.matches(Some(&ETag::from_version(4))));
    assert!(!m.matches(None));
    let weak = if_match(&["W/\"3\""]).unwrap().unwrap();
    assert!(!weak.matches(Some(&v3)), "If-Match uses strong comparison");
    assert_eq!(weak.version(), None);
    let list = if_match(&["\"1\", \"3\"", "\"9\""]).unwrap().unwrap();
    assert!(list.matches(Some(&v3)));
    assert_eq!(list.version(), None);
    let any = if_match(&["*"]).unwrap().unwrap();
    assert!(any.is_any() && any.matches(Some(&v3)) && !any.matches(None));
    for bad in ["3", "\"3", "*, \"3\"", "W/3", ""] {
        assert!(if_match(&[bad]).is_err(), "{bad:?}");
    }
}

#[test]
fn if_match_lists_span_field_lines_and_skip_empty_elements() {
    let v2 = ETag::from_version(2);
    for lines in [
        &["\"1\", \"2\""][..],
        &["\"1\"", "\"2\""],
        &["\"1\",\"2\""],
        &[" \"1\" ,\t\"2\" "],
        &[", \"1\", , \"2\","],
        &["W/\"2\", \"2\""],
        &["\"1\"", "", "\"2\""],
    ] {
        let m = if_match(lines).unwrap().unwrap();
        assert!(m.matches(Some(&v2)), "{lines:?}");
        assert!(!m.matches(Some(&ETag::from_version(3))), "{lines:?}");
        assert!(!m.matches(None), "{lines:?}");
        assert!(!m.is_any());
    }
    let m = if_match(&["\"1\", \"2\"", "\"1\""]).unwrap().unwrap();
    assert_eq!(m.versions(), vec![1, 2]);
    assert_eq!(m.version(), None, "one version only for one tag");
}

#[test]
fn weak_tags_never_match_if_match() {
    let v1 = ETag::from_version(1);
    let m = if_match(&["W/\"1\"", "W/\"2\""]).unwrap().unwrap();
    assert!(!m.matches(Some(&v1)));
    assert!(m.versions().is_empty());
    assert_eq!(m.version(), None);
}

#[test]
fn a_comma_inside_quotes_is_part_of_the_tag() {
    let tag = ETag::new("a,b").unwrap();
    let m = if_match(&["\"x\", \"a,b\""]).unwrap().unwrap();
    assert!(m.matches(Some(&tag)));
    assert!(!m.matches(Some(&ETag::new("a").unwrap())));
    let inm = parse_list(
        &headers(header::IF_NONE_MATCH, &["W/\"a,b\""]),
        &header::IF_NONE_MATCH,
    )
    .unwrap()
    .map(IfNoneMatch)
    .unwrap();
    assert!(!inm.holds(Some(&tag)), "weak comparison for If-None-Match");
}

#[test]
fn star_matches_any_current_representation() {
    for lines in [&["*"][..], &[" * "], &["*", "*"], &["*,"]] {
        let any = if_match(lines).unwrap().unwrap();
        assert!(any.is_any(), "{lines:?}");
        assert!(any.matches(Some(&ETag::new("anything").unwrap())));
        assert!(!any.matches(None), "* needs a current representation");
        assert_eq!(any.version(), None);
        assert!(any.versions().is_empty());
    }
}

#[test]
fn versions_agree_with_strong_comparison() {
    for opaque in ["07", "+7", "7 ", "-0", "9223372036854775808"] {
        let line = format!("\"{}\"", opaque.trim());
        let m = if_match(&[&line]).unwrap().unwrap();
        let v = m.version();
        assert!(
            v.is_none_or(|v| m.matches(Some(&ETag::from_version(v)))),
            "{opaque:?} names {v:?} but does not match it"
        );
    }
    assert_eq!(ETag::new("07").unwrap().version(), None);
    assert_eq!(ETag::from_version(-3).version(), Some(-3));
}

#[test]
fn malformed_preconditions_are_errors_that_say_why() {
    for bad in [
        "\"1\" \"2\"",
        "\"1\"\"2\"",
        "\"1\" x",
        "\"a\"b",
        "w/\"1\"",
        "W/ \"1\"",
        "W/",
        "\"",
        "\"1\", \"2",
        "**",
        "*x",
        "\"1\", *",
        "1, 2",
        "'1'",
        ",",
        " ",
    ] {
        let err = if_match(&[bad]).expect_err(bad);
        assert!(err.starts_with("if-match"), "{bad:?}: {err}");
    }
    let err = if_match(&["\"1\", x"]).unwrap_err();
    assert!(err.contains("\"x\" is not an entity tag"), "{err}");
    let err = if_match(&["*", "\"1\""]).unwrap_err();
    assert!(err.contains("cannot be combined"), "{err}");
    let long = format!("x{}", "y".repeat(1000));
    let err = if_match(&[&long]).unwrap_err();
    assert!(err.len() < 200, "the detail quotes a bounded part: {err}");
    let mut h = HeaderMap::new();
    h.append(
        header::IF_MATCH,
        HeaderValue::from_bytes(b"\"caf\xe9\"").unwrap(),
    );
    assert!(parse_list(&h, &header::IF_MATCH)
        .unwrap_err()
        .contains("outside visible ASCII"));
}

#[test]
fn if_none_match_star_means_create_only() {
    let any = parse_list(
        &headers(header::IF_NONE_MATCH, &["*"]),
        &header::IF_NONE_MATCH,
    )
    .unwrap()
    .map(IfNoneMatch)
    .unwrap();
    assert!(any.is_any());
    assert!(any.holds(None));
    assert!(!any.holds(Some(&ETag::from_version(1))));
}
