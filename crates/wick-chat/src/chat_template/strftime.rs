//! `strftime` as Python's `datetime.strftime` gives it on Linux (glibc, C locale) for a naive
//! datetime: `%d %b %Y` → `14 Mar 2025`, `%z` and `%Z` empty, `%f` microseconds, glibc's `-`,
//! `_`, `0` and `^` flags and field widths, unknown directives copied as they are.

use super::clock::CivilTime;

const WEEKDAYS: [&str; 7] = [
    "Sunday",
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
];
const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];

/// How a numeric field is padded: glibc's default for the directive, or a flag's choice.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Padding {
    Zero,
    Space,
    None,
}

/// Formats `time` with a Python/glibc `strftime` format string.
pub fn strftime(time: &CivilTime, format: &str) -> String {
    let mut out = String::new();
    let mut chars = format.chars().peekable();
    while let Some(ch) = chars.next() {
        if ch != '%' {
            out.push(ch);
            continue;
        }
        // A directive: %[flag][width]conversion.
        let mut spec = String::from("%");
        let mut flag = None;
        if let Some(&c @ ('-' | '_' | '0' | '^' | '#')) = chars.peek() {
            flag = Some(c);
            spec.push(c);
            chars.next();
        }
        let mut width = None;
        while let Some(&c) = chars.peek() {
            if let Some(digit) = c.to_digit(10) {
                width = Some(
                    width
                        .unwrap_or(0usize)
                        .saturating_mul(10)
                        .saturating_add(digit as usize),
                );
                spec.push(c);
                chars.next();
            } else {
                break;
            }
        }
        let Some(conversion) = chars.next() else {
            out.push_str(&spec);
            break;
        };
        match directive(time, conversion) {
            Some(Field::Number(value, digits, default_pad)) => {
                let pad = match flag {
                    Some('-') => Padding::None,
                    Some('_') => Padding::Space,
                    Some('0') => Padding::Zero,
                    _ => default_pad,
                };
                let width = width.unwrap_or(digits);
                let text = value.unsigned_abs().to_string();
                let sign = if value < 0 { "-" } else { "" };
                let fill = width.saturating_sub(text.len() + sign.len());
                out.push_str(sign);
                match pad {
                    Padding::Zero => out.extend(std::iter::repeat_n('0', fill)),
                    Padding::Space => out.extend(std::iter::repeat_n(' ', fill)),
                    Padding::None => {}
                }
                out.push_str(&text);
            }
            Some(Field::Text(text)) => {
                let text = if flag == Some('^') {
                    text.to_uppercase()
                } else {
                    text
                };
                if let Some(width) = width {
                    let fill = if flag == Some('0') { '0' } else { ' ' };
                    out.extend(std::iter::repeat_n(
                        fill,
                        width.saturating_sub(text.chars().count()),
                    ));
                }
                out.push_str(&text);
            }
            None => {
                spec.push(conversion);
                out.push_str(&spec);
            }
        }
    }
    out
}

enum Field {
    /// A number, its usual width and padding.
    Number(i64, usize, Padding),
    Text(String),
}

fn directive(t: &CivilTime, conversion: char) -> Option<Field> {
    let weekday = t.weekday_from_sunday() as usize;
    let month = t.month.clamp(1, 12) as usize - 1;
    let hour12 = match t.hour % 12 {
        0 => 12,
        h => h,
    };
    let number = |value: i64, digits: usize| Some(Field::Number(value, digits, Padding::Zero));
    let spaced = |value: i64, digits: usize| Some(Field::Number(value, digits, Padding::Space));
    let text = |s: String| Some(Field::Text(s));
    match conversion {
        'a' => text(WEEKDAYS[weekday][..3].to_string()),
        'A' => text(WEEKDAYS[weekday].to_string()),
        'b' | 'h' => text(MONTHS[month][..3].to_string()),
        'B' => text(MONTHS[month].to_string()),
        'c' => text(strftime(t, "%a %b %e %H:%M:%S %Y")),
        'C' => number(i64::from(t.year).div_euclid(100), 2),
        'd' => number(t.day.into(), 2),
        'D' | 'x' => text(strftime(t, "%m/%d/%y")),
        'e' => spaced(t.day.into(), 2),
        'f' => number(t.microsecond.into(), 6),
        'F' => text(strftime(t, "%Y-%m-%d")),
        'G' => number(iso_week(t).0.into(), 4),
        'g' => number(i64::from(iso_week(t).0).rem_euclid(100), 2),
        'H' => number(t.hour.into(), 2),
        'I' => number(hour12.into(), 2),
        'j' => number(t.day_of_year().into(), 3),
        'k' => spaced(t.hour.into(), 2),
        'l' => spaced(hour12.into(), 2),
        'm' => number(t.month.into(), 2),
        'M' => number(t.minute.into(), 2),
        'n' => text("\n".to_string()),
        'p' => text(if t.hour < 12 { "AM" } else { "PM" }.to_string()),
        'P' => text(if t.hour < 12 { "am" } else { "pm" }.to_string()),
        'r' => text(strftime(t, "%I:%M:%S %p")),
        'R' => text(strftime(t, "%H:%M")),
        's' => number(t.unix_seconds(), 1),
        'S' => number(t.second.into(), 2),
        't' => text("\t".to_string()),
        'T' | 'X' => text(strftime(t, "%H:%M:%S")),
        'u' => number(if weekday == 0 { 7 } else { weekday as i64 }, 1),
        'U' => number(((t.day_of_year() as i64 - 1) + 7 - weekday as i64) / 7, 2),
        'V' => number(iso_week(t).1.into(), 2),
        'w' => number(weekday as i64, 1),
        'W' => number(
            ((t.day_of_year() as i64 - 1) + 7 - ((weekday as i64 + 6) % 7)) / 7,
            2,
        ),
        'y' => number(i64::from(t.year).rem_euclid(100), 2),
        'Y' => Some(Field::Number(t.year.into(), 1, Padding::Zero)),
        // A naive datetime has no offset and no zone name.
        'z' | 'Z' => text(String::new()),
        '%' => text("%".to_string()),
        _ => None,
    }
}

/// ISO 8601 week-numbering year and week (weeks start on Monday; week 1 holds the first Thursday).
fn iso_week(t: &CivilTime) -> (i32, u32) {
    let monday_based = (t.weekday_from_sunday() + 6) % 7; // 0 = Monday
    let ordinal = t.day_of_year() as i64;
    let week = (ordinal - monday_based as i64 + 9) / 7;
    if week < 1 {
        let previous = CivilTime {
            year: t.year - 1,
            month: 12,
            day: 31,
            ..*t
        };
        return iso_week(&previous);
    }
    let days_in_year = if CivilTime::new(t.year, 2, 29, 0, 0, 0).is_some() {
        366
    } else {
        365
    };
    // The last days of December belong to week 1 of the next year when that week's Thursday does.
    if week == 53 && ordinal - monday_based as i64 + 3 > days_in_year {
        return (t.year + 1, 1);
    }
    (t.year, week as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(y: i32, mo: u32, d: u32, h: u32, mi: u32, s: u32) -> CivilTime {
        CivilTime::new(y, mo, d, h, mi, s).unwrap()
    }

    /// Expected strings produced by Python 3 `datetime.strftime` on Linux.
    #[test]
    fn matches_python_on_linux() {
        let t = at(2025, 3, 14, 9, 26, 53);
        let cases = [
            ("%a %A %b %B %h", "Fri Friday Mar March Mar"),
            ("%c", "Fri Mar 14 09:26:53 2025"),
            ("%C %d %D %e %F", "20 14 03/14/25 14 2025-03-14"),
            ("%G %g %V %U %W %u %w", "2025 25 11 10 10 5 5"),
            ("%H %I %j %k %l %m %M", "09 09 073  9  9 03 26"),
            ("%p %P %r %R %S %T", "AM am 09:26:53 AM 09:26 53 09:26:53"),
            ("%x %X %y %Y", "03/14/25 09:26:53 25 2025"),
            ("[%z][%Z]", "[][]"),
            ("%f %%", "000000 %"),
            ("%-d %-m %_d %0e %^a %^B", "14 3 14 14 FRI MARCH"),
            ("%Q %E", "%Q %E"),
            ("%", "%"),
            ("%5d", "00014"),
            ("%d %b %Y", "14 Mar 2025"),
            ("%B %d, %Y", "March 14, 2025"),
        ];
        for (format, expected) in cases {
            assert_eq!(strftime(&t, format), expected, "{format}");
        }
        let f = "%G %g %V %U %W %j %I %l %p";
        assert_eq!(
            strftime(&at(2021, 1, 3, 0, 5, 7), f),
            "2020 20 53 01 00 003 12 12 AM"
        );
        assert_eq!(
            strftime(&at(2020, 12, 31, 13, 5, 7), f),
            "2020 20 53 52 52 366 01  1 PM"
        );
        assert_eq!(strftime(&at(2024, 12, 30, 0, 0, 0), "%G-W%V"), "2025-W01");
    }
}
